"""The drafter as an EAGLE-format checkpoint for serving engines (safetensors + config.json).

The format is the one of the EAGLE authors' published EAGLE-1 checkpoints, which SGLang's
`LlamaForCausalLMEagle` / `Qwen2ForCausalLMEagle` and vLLM's `EagleLlamaForCausalLM` load
(`--speculative-algorithm EAGLE` / `"method": "eagle"`). Tensor names, [out, in] layout:

  fc.weight [H, 2H], fc.bias [H]      input fusion; the input is concat(embed(x_{t+1}), f_t) in that order
  layers.0.self_attn.{q,k,v,o}_proj.weight (+ .bias for q/k/v when the target has qkv bias)
  layers.0.self_attn.{q,k}_norm.weight  (Qwen3 targets only)
  layers.0.post_attention_layernorm.weight
  layers.0.mlp.{gate,up,down}_proj.weight
  embed_tokens.weight [V, H]          the target's embedding (serving engines share it or load it)
  lm_head.weight [V, H]               the target's lm_head (its embedding when tied); [N, H], its rows
                                      of the draft vocabulary, for a reduced-vocabulary drafter, with
  d2t [N] int64, t2d [V] bool         EAGLE-3's vocabulary maps: draft id i is target id i + d2t[i];
                                      t2d marks the target ids in the draft vocabulary

There is no `layers.0.input_layernorm` (EAGLE drops it) and no final norm. config.json is the
target's Hugging Face config with `num_hidden_layers: 1` and `bias: true` (fc has a bias, as in
EAGLE-1; SGLang reads this key, while vLLM's Llama EAGLE module builds fc without bias and
ignores `fc.bias`, so serve a tlt_jax drafter there only after checking that). A reduced head adds
`draft_vocab_size: N` to config.json, as EAGLE-3 checkpoints carry it. The embedding and
lm_head are snapshots of the policy at export time: export after the last RL step.

EAGLE-3 drafters are not exported: their published format (midlayer.*, a 2H-input attention,
d2t/t2d vocabulary maps) is a different architecture from tlt_jax's fused-feature drafter.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import safetensors.numpy
from flax import nnx

from tlt_jax import files
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import hf
from tlt_jax.models.transformer import CausalLM

WEIGHTS_FILE = "model.safetensors"


def eagle_tensors(target: CausalLM, drafter: Drafter) -> dict[str, np.ndarray]:
  """EAGLE tensor name -> host array ([out, in] for linear weights)."""
  if drafter.feature_layers:
    raise ValueError(f"EAGLE-3 drafters (feature_layers={list(drafter.feature_layers)}) have no EAGLE-format export")
  host = lambda x: np.asarray(jax.device_get(x))
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
    path = ("layers", 0, *path[1:]) if path[0] == "layer" else path
    value = host(var.get_value())
    out[hf.hf_name(path)] = value.T if path[-1] == "kernel" else value
  embedding = host(target.model.embed_tokens.embedding.get_value())
  out["embed_tokens.weight"] = embedding
  out["lm_head.weight"] = embedding if target.config.tie_word_embeddings else host(
      target.lm_head.kernel.get_value()).T
  if drafter.draft_vocab:
    ids = np.asarray(drafter.draft_vocab, np.int64)
    out["lm_head.weight"] = out["lm_head.weight"][ids]
    out["d2t"] = ids - np.arange(len(ids))
    out["t2d"] = np.isin(np.arange(target.config.vocab_size), ids)
  return out


def eagle_config(target: CausalLM, drafter: Drafter, dtype: str) -> dict:
  config = {**target.config.to_hf(), "num_hidden_layers": 1, "bias": True, "tie_word_embeddings": False,
            "torch_dtype": dtype}
  if drafter.draft_vocab:
    config["draft_vocab_size"] = len(drafter.draft_vocab)
  return config


def export_eagle(target: CausalLM, drafter: Drafter, out_dir: str) -> dict[str, tuple[int, ...]]:
  """Writes `out_dir` (replacing it) atomically; returns the tensor shapes written."""
  tensors = {k: np.ascontiguousarray(v) for k, v in eagle_tensors(target, drafter).items()}
  with files.atomic_directory(out_dir) as tmp:
    safetensors.numpy.save_file(tensors, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
      json.dump(eagle_config(target, drafter, tensors["fc.weight"].dtype.name), f, indent=2)
  return {k: v.shape for k, v in tensors.items()}
