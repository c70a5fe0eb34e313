"""`python -m tlt_jax.export_drafter`: EAGLE tensor names, shapes and values, read back with safetensors."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy
import transformers
from flax import nnx

from tlt_jax.drafter import checkpoint, export
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


def check(out_dir, torch_model, drafter, extra_layer_tensors):
  tensors = safetensors.numpy.load_file(os.path.join(out_dir, export.WEIGHTS_FILE))
  expected = {"fc.weight", "fc.bias", "embed_tokens.weight", "lm_head.weight",
              *(f"layers.0.{n}" for n in LAYER + extra_layer_tensors)}
  assert set(tensors) == expected
  # Embedding and lm_head are the target's, as transformers holds them.
  np.testing.assert_array_equal(tensors["embed_tokens.weight"], torch_model.model.embed_tokens.weight.detach().numpy())
  np.testing.assert_array_equal(tensors["lm_head.weight"], torch_model.lm_head.weight.detach().numpy())
  h = torch_model.config.hidden_size
  assert tensors["fc.weight"].shape == (h, 2 * h)
  np.testing.assert_array_equal(tensors["fc.weight"], np.asarray(drafter.fc.kernel.get_value()).T)
  np.testing.assert_array_equal(tensors["layers.0.mlp.down_proj.weight"],
                                np.asarray(drafter.layer.mlp.down_proj.kernel.get_value()).T)
  q = drafter.layer.self_attn.q_proj
  assert tensors["layers.0.self_attn.q_proj.weight"].shape == q.kernel.get_value().shape[::-1]
  config = transformers.AutoConfig.from_pretrained(out_dir)
  assert config.num_hidden_layers == 1 and config.hidden_size == h and json.load(open(f"{out_dir}/config.json"))["bias"]


def test_cli_exports_an_untied_qwen2_drafter(hf_dirs, tmp_path):
  path, torch_model = hf_dirs["qwen2_untied"]
  target_config, _ = hf.read_config(path)
  drafter = Drafter(target_config, rngs=nnx.Rngs(3))
  checkpoint.save_drafter(drafter, str(tmp_path / "drafter"))
  out = tmp_path / "eagle"
  run = subprocess.run([sys.executable, "-m", "tlt_jax.export_drafter", f"--model={path}",
                        f"--drafter={tmp_path / 'drafter'}", f"--output={out}"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, check=False)
  assert run.returncode == 0, run.stderr
  assert json.loads(run.stdout.strip().splitlines()[-1])["tensors"] == 4 + len(LAYER) + 3
  check(str(out), torch_model, drafter, ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"])


def test_tied_qwen3_target_and_no_eagle3(hf_dirs, tmp_path):
  path, torch_model = hf_dirs["qwen3"]
  target = hf.from_pretrained(path)
  drafter = Drafter(target.config, rngs=nnx.Rngs(4))
  export.export_eagle(target, drafter, str(tmp_path / "eagle"))
  check(str(tmp_path / "eagle"), torch_model, drafter, ["self_attn.q_norm.weight", "self_attn.k_norm.weight"])
  deeper = dataclasses.replace(target.config, num_layers=3)
  with pytest.raises(ValueError, match=r"EAGLE-3 drafters \(feature_layers=\[0, 1, 2\]\)"):
    export.eagle_tensors(target, Drafter(deeper, feature_layers=(0, 1, 2), rngs=nnx.Rngs(0)))


def test_reduced_vocabulary_drafter_exports_eagle3_vocabulary_maps(hf_dirs, tmp_path):
  """A reduced head exports its lm_head rows and EAGLE-3's d2t / t2d, which map draft ids back."""
  path, torch_model = hf_dirs["qwen2_untied"]
  target = hf.from_pretrained(path)
  vocab = (2, 3, 5, 17, 40, 95)
  drafter = Drafter(target.config, draft_vocab=vocab, rngs=nnx.Rngs(5))
  export.export_eagle(target, drafter, str(tmp_path / "eagle"))
  tensors = safetensors.numpy.load_file(str(tmp_path / "eagle" / export.WEIGHTS_FILE))
  d2t, t2d = tensors["d2t"], tensors["t2d"]
  np.testing.assert_array_equal(np.arange(len(vocab)) + d2t, vocab)
  assert t2d.dtype == bool and t2d.shape == (target.config.vocab_size,) and np.flatnonzero(t2d).tolist() == list(vocab)
  np.testing.assert_array_equal(tensors["lm_head.weight"], torch_model.lm_head.weight.detach().numpy()[list(vocab)])
  assert json.load(open(tmp_path / "eagle" / "config.json"))["draft_vocab_size"] == len(vocab)
