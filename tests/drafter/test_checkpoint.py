"""Drafter checkpoints: exact round trip, target mismatch named, nothing half-written."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter import checkpoint
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import ModelConfig

CFG = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, tie_word_embeddings=True, eos_token_id=(1, 2))


def params(drafter):
  return jax.tree.map(np.asarray, nnx.state(drafter, nnx.Param))


@pytest.mark.parametrize("layers, vocab", [((), ()), ((0, 1, 2), ()), ((), (0, 5, 7, 63))])
def test_round_trip(layers, vocab, tmp_path):
  drafter = Drafter(CFG, feature_layers=layers, draft_vocab=vocab, rngs=nnx.Rngs(3))
  out = str(tmp_path / "drafter")
  checkpoint.save_drafter(drafter, out)
  checkpoint.save_drafter(drafter, out)  # replaces what is there
  assert sorted(os.listdir(tmp_path)) == ["drafter"]
  assert sorted(os.listdir(out)) == [checkpoint.CONFIG_FILE, checkpoint.PARAMS_DIR]
  loaded = checkpoint.load_drafter(out, CFG)
  assert loaded.feature_layers == layers and loaded.draft_vocab == vocab and loaded.config == CFG
  jax.tree.map(np.testing.assert_array_equal, params(drafter), params(loaded))


def test_mismatched_target_is_named(tmp_path):
  out = str(tmp_path / "drafter")
  checkpoint.save_drafter(Drafter(CFG, rngs=nnx.Rngs(0)), out)
  with pytest.raises(checkpoint.DrafterCheckpointError, match=r"drafter_config.json: .* with hidden_size=32, "
                     r"but this target has hidden_size=64"):
    checkpoint.load_drafter(out, dataclasses.replace(CFG, hidden_size=64))
  with pytest.raises(checkpoint.DrafterCheckpointError, match=r"eos_token_id=\[1, 2\], but this target has "
                     r"eos_token_id=1"):
    checkpoint.load_drafter(out, dataclasses.replace(CFG, eos_token_id=1))
  # The target's layer form is not its architecture: a drafter serves the scanned and the unrolled form,
  # also one saved before the form was recorded.
  unrolled = dataclasses.replace(CFG, scan_layers=not CFG.scan_layers)
  assert checkpoint.load_drafter(out, unrolled).config == unrolled
  config_file = os.path.join(out, checkpoint.CONFIG_FILE)
  with open(config_file) as f:
    saved = json.load(f)
  saved["target"].pop("scan_layers", None)
  with open(config_file, "w") as f:
    json.dump(saved, f)
  checkpoint.load_drafter(out, CFG)


def test_missing_and_broken_checkpoints(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    checkpoint.load_drafter(str(tmp_path / "nowhere"), CFG)
  with pytest.raises(FileNotFoundError, match="drafter_config.json not found"):
    checkpoint.load_drafter(str(tmp_path), CFG)
  (tmp_path / checkpoint.CONFIG_FILE).write_text("{")
  with pytest.raises(checkpoint.DrafterCheckpointError, match="drafter_config.json: invalid JSON"):
    checkpoint.load_drafter(str(tmp_path), CFG)
  (tmp_path / checkpoint.CONFIG_FILE).write_text(json.dumps({"format_version": 1, "feature_layers": []}))
  with pytest.raises(checkpoint.DrafterCheckpointError, match="missing key 'dtype'"):
    checkpoint.load_drafter(str(tmp_path), CFG)


def test_draft_vocabulary_outside_the_target_is_refused(tmp_path):
  out = str(tmp_path / "drafter")
  checkpoint.save_drafter(Drafter(CFG, draft_vocab=(0, 5, 63), rngs=nnx.Rngs(0)), out)
  config = json.load(open(os.path.join(out, checkpoint.CONFIG_FILE)))
  config["draft_vocab"] = [0, 5, 64]
  json.dump(config, open(os.path.join(out, checkpoint.CONFIG_FILE), "w"))
  with pytest.raises(checkpoint.DrafterCheckpointError,
                     match="drafter_config.json: the draft vocabulary .3 tokens. maps to target id 64, outside the "
                           "target's vocabulary of 64"):
    checkpoint.load_drafter(out, CFG)


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
  def fail(*args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr(checkpoint.json, "dump", fail)
  with pytest.raises(OSError, match="disk full"):
    checkpoint.save_drafter(Drafter(CFG, rngs=nnx.Rngs(0)), str(tmp_path / "drafter"))
  assert os.listdir(tmp_path) == []
