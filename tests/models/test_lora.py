"""LoRA adapters against `peft` on `transformers` models: PEFT's files in and out give PEFT's logits, a fresh
adapter leaves the model as it was, merged weights compute what the adapters do, and bad targets or
adapters are refused by name."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from flax import nnx

from tests.conftest import VOCAB, build_hf_model
from tlt_jax.models import KVCache, hf, lora, prefill

TOL = 1e-4
IDS = np.random.RandomState(0).randint(2, VOCAB, (2, 9))


def _logits(model) -> np.ndarray:
  out = jax.jit(lambda g, s, t: prefill(nnx.merge(g, s), t, jnp.full((2,), 9), KVCache.zeros(model.config, 2, 16),
                                        all_logits=True).logits)(*nnx.split(model), IDS)
  return np.asarray(out)


def _peft_logits(peft_model) -> np.ndarray:
  with torch.no_grad():
    return peft_model(torch.tensor(IDS)).logits.numpy()


def _peft_adapter(family, directory, **lora_config):
  """A PEFT adapter with random non-zero A and B on the family's tiny model, saved; returns the PEFT model."""
  torch.manual_seed(1)
  config = peft.LoraConfig(init_lora_weights=False, **lora_config)
  model = peft.get_peft_model(build_hf_model(family), config).eval()
  model.save_pretrained(directory)
  return model


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
@pytest.mark.parametrize("family,lora_config", [
    ("llama3", dict(r=4, lora_alpha=8, target_modules="all-linear")),
    ("qwen2_untied", dict(r=2, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True)),
    ("qwen3", dict(r=3, lora_alpha=6, target_modules=r".*\.(k_proj|up_proj)")),
])
def test_a_peft_adapter_gives_peft_logits(family, lora_config, scan_layers, hf_dirs, tmp_path):
  reference = _peft_adapter(family, str(tmp_path), **lora_config)
  model = hf.from_pretrained(hf_dirs[family][0], scan_layers=scan_layers)
  spec = lora.load_peft(model, str(tmp_path))
  assert spec.rank == lora_config["r"] and spec.rslora == bool(lora_config.get("use_rslora"))
  np.testing.assert_allclose(_logits(model), _peft_logits(reference), atol=TOL, rtol=0)
  # Folded into the weights, the adapters compute the same.
  np.testing.assert_allclose(_logits(lora.merged(model)), _peft_logits(reference), atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["llama3", "qwen2_tied"])
def test_an_exported_adapter_loads_in_peft_with_our_logits(family, hf_dirs, tmp_path):
  path, reference = hf_dirs[family]
  model = hf.from_pretrained(path)
  lora.attach(model, lora.Spec(4, 32.0, "all-linear"), seed=3)
  assert lora.is_identity(model)  # fresh: B = 0
  for _, variable in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):  # B non-zero too
    variable.set_value(variable.get_value() + 0.02 * jax.random.normal(jax.random.key(0), variable.get_value().shape))
  assert not lora.is_identity(model)
  lora.save_peft(model, str(tmp_path), base_model=path)
  assert json.load(open(tmp_path / "adapter_config.json"))["target_modules"] == sorted(lora.ALL_LINEAR)
  loaded = peft.PeftModel.from_pretrained(build_hf_model(family), str(tmp_path)).eval()
  ours = _logits(model)
  assert np.abs(ours - _logits(hf.from_pretrained(path))).max() > 1e-2  # the adapter changes the logits
  np.testing.assert_allclose(ours, _peft_logits(loaded), atol=TOL, rtol=0)
  # And back: our own export reads as it was written.
  again = hf.from_pretrained(path)
  lora.load_peft(again, str(tmp_path))
  np.testing.assert_array_equal(_logits(again), ours)


def test_a_fresh_adapter_leaves_the_model_bit_identical(hf_dirs):
  path, _ = hf_dirs["qwen3"]
  model = hf.from_pretrained(path)
  before = _logits(model)
  names = lora.attach(model, lora.Spec(8, 16.0, "all-linear"))
  assert len(names) == 2 * len(lora.ALL_LINEAR) and names[0] == "model.layers.0.mlp.down_proj"
  np.testing.assert_array_equal(_logits(model), before)  # B = 0
  a = nnx.state(model, nnx.LoRAParam)["model"]["layers"]["self_attn"]["q_proj"]["lora"]["lora_a"].get_value()
  assert a.shape == (2, 32, 8) and 0 < float(jnp.abs(a).max()) <= 1 / np.sqrt(32)  # PEFT's kaiming-uniform A


def test_bad_targets_and_adapters_are_refused_by_name(hf_dirs, tmp_path, caplog):
  model = hf.from_pretrained(hf_dirs["llama3"][0])
  # One misspelled name among good ones: PEFT adapts the rest in silence; here it is one line.
  assert len(lora.attach(hf.from_pretrained(hf_dirs["llama3"][0]), lora.Spec(2, 4.0, ("q_proj", "v_prj")))) == 2
  assert "LoRA target_modules ['v_prj'] match no module of the decoder (adapting ['q_proj'])" in caplog.text
  with pytest.raises(lora.AdapterError, match=r"matches no module; the decoder's linear modules are "
                     r"model.layers.<i>.\{self_attn,mlp\}.\{down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj\}"):
    lora.attach(model, lora.Spec(2, 4.0, ("qkv",)))
  with pytest.raises(lora.AdapterError, match=r"selects 1 of the 2 layers of model.layers.\*.self_attn.q_proj"):
    lora.attach(model, lora.Spec(2, 4.0, r"model\.layers\.0\.self_attn\.q_proj"))
  unrolled = hf.from_pretrained(hf_dirs["llama3"][0], scan_layers=False)  # one layer alone, unrolled
  assert lora.attach(unrolled, lora.Spec(2, 4.0, r"model\.layers\.0\.self_attn\.q_proj")) == [
      "model.layers.0.self_attn.q_proj"]
  with pytest.raises(lora.AdapterError, match=r"target_modules='\(q' is not a regular expression"):
    lora.attach(model, lora.Spec(2, 4.0, "(q"))
  with pytest.raises(lora.AdapterError, match="rank 0: a LoRA rank is at least 1"):
    lora.attach(model, lora.Spec(0, 4.0, "all-linear"))
  _peft_adapter("qwen3", str(tmp_path), r=2, lora_alpha=4, target_modules=["q_proj"])  # q_proj 32 -> 64 there
  with pytest.raises(lora.AdapterError, match=r"model.layers.0.self_attn.q_proj.lora_B.weight is \[64, 2\], the "
                     r"model's needs \[32, 2\]: an adapter of another base model"):
    lora.load_peft(hf.from_pretrained(hf_dirs["llama3"][0]), str(tmp_path))
  config = json.load(open(tmp_path / "adapter_config.json"))
  json.dump({**config, "use_dora": True}, open(tmp_path / "adapter_config.json", "w"))
  with pytest.raises(lora.AdapterError, match="use_dora=True is not supported"):
    lora.read_spec(str(tmp_path))


def test_the_fingerprint_names_the_weights(hf_dirs, tmp_path):
  path = hf_dirs["llama3"][0]
  assert lora.fingerprint(path) == lora.fingerprint(path)
  hf.save_pretrained(hf.from_pretrained(hf_dirs["qwen3"][0]), str(tmp_path))
  assert lora.fingerprint(str(tmp_path)) != lora.fingerprint(path)
