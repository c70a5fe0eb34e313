"""Hugging Face checkpoints: round trips through `transformers`, sharded files, clear errors."""

import json
import os
import shutil

import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

from absl import flags

from tests.conftest import VOCAB, build_hf_model
from tlt_jax import cli
from tlt_jax.models import KVCache, hf, transformer
from tlt_jax.models.config import ConfigError

import jax
import jax.numpy as jnp


def our_logits(model, ids):
  out = transformer.prefill(model, jnp.asarray(ids), jnp.full((ids.shape[0],), ids.shape[1]),
                            KVCache.zeros(model.config, ids.shape[0], ids.shape[1]), all_logits=True)
  return np.asarray(out.logits)


def ref_logits(ref, ids):
  with torch.no_grad():
    return ref(torch.tensor(ids)).logits.numpy()


IDS = np.random.RandomState(0).randint(2, VOCAB, (2, 7))


def test_save_pretrained_round_trip(family, hf_dirs, tmp_path):
  path, ref = hf_dirs[family]
  model = hf.from_pretrained(path)
  out = str(tmp_path / "saved")
  hf.save_pretrained(model, out)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(reloaded) is type(ref)
  np.testing.assert_allclose(ref_logits(reloaded, IDS), ref_logits(ref, IDS), atol=1e-5, rtol=0)
  np.testing.assert_allclose(our_logits(hf.from_pretrained(out), IDS), ref_logits(ref, IDS), atol=1e-4, rtol=0)
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]  # no temp dir left behind


def test_tools_unroll_layers_on_a_cpu(hf_dirs, monkeypatch):
  """The tools' default: layers unrolled on a CPU (a scanned loop copies each layer's weights per step),
  scanned on accelerators; --scan_layers overrides; the library keeps the config's form unless told."""
  def resolved(*argv):
    values = flags.FlagValues()
    holder = flags.DEFINE_bool("scan_layers", None, "", flag_values=values)
    values(["tool", *argv])
    return cli.scan_layers(holder)

  assert [resolved(), resolved("--scan_layers"), resolved("--noscan_layers")] == [False, True, False]
  for backend in ("gpu", "tpu"):
    monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
    assert [resolved(), resolved("--scan_layers"), resolved("--noscan_layers")] == [True, True, False]
  path, _ = hf_dirs["qwen2_untied"]
  assert [hf.from_pretrained(path, scan_layers=s).config.scan_layers for s in (None, False)] == [True, False]


def test_sharded_checkpoint_with_index(hf_dirs, tmp_path):
  """Both layer forms write the same files (a layer's tensors together, layer by layer) and read them."""
  path, ref = hf_dirs["qwen2_untied"]
  indexes = []
  for scan in (True, False):
    out = str(tmp_path / f"sharded_{scan}")
    hf.save_pretrained(hf.from_pretrained(path, scan_layers=scan), out, max_shard_bytes=20_000)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) > 2 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    with open(os.path.join(out, "model.safetensors.index.json"), encoding="utf-8") as f:
      indexes.append(json.load(f))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(ref_logits(reloaded, IDS), ref_logits(ref, IDS), atol=1e-5, rtol=0)
    for read_scan in (True, False):
      np.testing.assert_allclose(our_logits(hf.from_pretrained(out, scan_layers=read_scan), IDS), ref_logits(ref, IDS),
                                 atol=1e-4, rtol=0)
  assert indexes[0] == indexes[1]
  layer_files = lambda i: {f for name, f in indexes[0]["weight_map"].items() if name.startswith(f"model.layers.{i}.")}
  assert max(layer_files(0)) <= min(layer_files(1))


def test_bfloat16_checkpoint(tmp_path):
  ref = build_hf_model("qwen3").to(torch.bfloat16)
  ref.save_pretrained(tmp_path)
  model = hf.from_pretrained(str(tmp_path))
  assert model.model.embed_tokens.embedding.dtype == jnp.bfloat16
  # bf16 weights upcast to float32 on load give the float32 model of the same weights.
  ref32 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
  model32 = hf.from_pretrained(str(tmp_path), dtype="float32")
  np.testing.assert_allclose(our_logits(model32, IDS), ref_logits(ref32, IDS), atol=1e-4, rtol=0)
  # Float32 masters of a bfloat16 checkpoint computing in bfloat16 (an RL policy): saved in the
  # checkpoint's dtype by default, bit for bit, or in float32 on request.
  masters = hf.from_pretrained(str(tmp_path), param_dtype="float32")
  assert hf.checkpoint_dtype(str(tmp_path)) == "bfloat16" and masters.dtype == jnp.bfloat16
  assert masters.model.embed_tokens.embedding.dtype == jnp.float32
  for dtype, out in (("bfloat16", tmp_path / "bf16"), ("float32", tmp_path / "f32")):
    hf.save_pretrained(masters, str(out), dtype=dtype)
    assert hf.checkpoint_dtype(str(out)) == dtype
    saved = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, tensor in ref.state_dict().items():
      assert torch.equal(saved.state_dict()[name], tensor.float()), name


def test_tokenizer_travels_with_the_model(hf_dirs, tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {chr(ord("a") + i): i for i in range(26)}
  vocab["[UNK]"] = 26
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
  path, _ = hf_dirs["qwen2_tied"]
  assert hf.load_tokenizer(path) is None
  out = str(tmp_path / "with_tok")
  hf.save_pretrained(hf.from_pretrained(path), out, tokenizer=fast)
  assert hf.load_tokenizer(out)("abc")["input_ids"] == [0, 1, 2]


def test_a_generic_tokenizer_in_a_qwen2_directory_loads_as_itself(hf_dirs, tmp_path):
  """AutoTokenizer would load it as Qwen2Tokenizer (byte-level: spaces and newlines lost)."""
  from tlt_jax.rl import tokenizer as tokenizer_lib
  out = str(tmp_path / "qwen2")
  hf.save_pretrained(hf.from_pretrained(hf_dirs["qwen2_tied"][0]), out, tokenizer=tokenizer_lib.build_tokenizer())
  tok, text = hf.load_tokenizer(out), "3 + 4 = 7\nAnswer: 7"
  assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
  assert "Qwen2Tokenizer" in type(transformers.AutoTokenizer.from_pretrained(out)).__name__  # what it avoids


def copy_model(hf_dirs, tmp_path, family="qwen2_tied"):
  dst = tmp_path / "copy"
  shutil.copytree(hf_dirs[family][0], dst)
  return dst


def test_bad_tensor_shape_is_named(hf_dirs, tmp_path):
  dst = copy_model(hf_dirs, tmp_path)
  tensors = safetensors.torch.load_file(dst / "model.safetensors")
  tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(63, 32)
  safetensors.torch.save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(hf.CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(63, 32\).*\(64, 32\)"):
    hf.from_pretrained(str(dst))


def test_missing_tensor_is_named(hf_dirs, tmp_path):
  dst = copy_model(hf_dirs, tmp_path)
  tensors = safetensors.torch.load_file(dst / "model.safetensors")
  del tensors["model.norm.weight"]
  safetensors.torch.save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(hf.CheckpointError, match=r"'model\.norm\.weight' is missing"):
    hf.from_pretrained(str(dst))


def test_unsupported_tensor_dtype_is_named(hf_dirs, tmp_path):
  dst = copy_model(hf_dirs, tmp_path)
  tensors = safetensors.torch.load_file(dst / "model.safetensors")
  tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
  safetensors.torch.save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(hf.CheckpointError, match=r"'model\.norm\.weight' has dtype I8"):
    hf.from_pretrained(str(dst))


def test_unknown_architecture_is_named(hf_dirs, tmp_path):
  dst = copy_model(hf_dirs, tmp_path)
  cfg = json.loads((dst / "config.json").read_text())
  cfg["architectures"] = ["MistralForCausalLM"]
  (dst / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ConfigError, match=r"MistralForCausalLM.*supported: Qwen2ForCausalLM, LlamaForCausalLM"):
    hf.from_pretrained(str(dst))


def test_unsupported_dtype_is_named(hf_dirs, tmp_path):
  dst = copy_model(hf_dirs, tmp_path)
  cfg = json.loads((dst / "config.json").read_text())
  cfg["dtype"] = cfg["torch_dtype"] = "float8_e4m3fn"
  (dst / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(hf.CheckpointError, match=r"config\.json: dtype 'float8_e4m3fn'"):
    hf.from_pretrained(str(dst))


def test_missing_files_are_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    hf.from_pretrained(str(tmp_path / "nope"))
  with pytest.raises(FileNotFoundError, match="config.json"):
    hf.from_pretrained(str(tmp_path))
