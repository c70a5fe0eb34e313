"""LoRA adapters on the policy's linear layers, as PEFT, TRL and verl train them, and PEFT's files in and out.

An adapted layer computes x W + b + scale (x A) B with A [in, r] and B [r, out] (`nnx.LoRA`'s, one per
`transformer.Linear`; stacked [L, in, r] / [L, r, out] in a scanned decoder), scale = alpha / r (alpha /
sqrt(r) with rsLoRA), A drawn as PEFT draws it and B zero, so that an adapter starts as the base model.
`merged` folds the adapters into the kernels (W + scale A B): the plain model the rollouts and exports use.

Targets follow PEFT's `target_modules`, matched against the Hugging Face module names
(`model.layers.3.self_attn.q_proj`): a tuple of names selects the modules whose name ends with one of
them, a string is a regular expression the whole name must match, "all-linear" every linear layer of
the decoder (q/k/v/o, gate/up/down; not the LM head). A scanned decoder's layers share one module,
adapted in every layer or none.

qwix's `LoraProvider` (tunix's) does not fit this model: it creates the adapters while it traces a call
of the live modules, and our decoder layers run from split state (one `lax.scan` body over stacked
layers, or a merged copy per layer unrolled), so its adapters land on temporary copies (unrolled: lost;
scanned: an error inside the scan's trace). The math is three lines, kept here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from typing import Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from tlt_jax.models.transformer import CausalLM, Linear

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


class AdapterError(ValueError):
  """A LoRA setting or adapter that does not fit the model; the message names what to change."""


@dataclasses.dataclass(frozen=True)
class Spec:
  """What PEFT's adapter_config.json says of an adapter."""
  rank: int
  alpha: float
  target_modules: str | tuple[str, ...]  # as PEFT matches them (module_names)
  rslora: bool = False

  @property
  def scale(self) -> float:
    return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def _decoder_linears(model: CausalLM) -> list[tuple[list[str], Linear]]:
  """(its Hugging Face module names, one per layer it holds; the module) of every linear layer of the decoder."""
  out = []
  for path, module in nnx.iter_modules(model):
    if isinstance(module, Linear) and path[:2] == ("model", "layers"):
      if isinstance(path[2], int):
        out.append(([".".join(map(str, path))], module))
      else:  # scanned: layer i is slice i of a stacked kernel
        layers = module.kernel.shape[0]
        out.append(([".".join(map(str, (*path[:2], i, *path[2:]))) for i in range(layers)], module))
  return out


def module_names(model: CausalLM, targets: str | Sequence[str]) -> list[str]:
  """The Hugging Face names of the decoder's linear layers that `targets` selects (PEFT's rule, module
  docstring); AdapterError when it selects none, or part of a scanned decoder's layers."""
  if targets == "all-linear":
    targets = ALL_LINEAR
  if isinstance(targets, str):
    try:
      pattern = re.compile(targets)
    except re.error as e:
      raise AdapterError(f"target_modules={targets!r} is not a regular expression ({e})") from None
    chosen = lambda name: pattern.fullmatch(name) is not None
  else:
    chosen = lambda name: any(name == t or name.endswith("." + t) for t in targets)
  linears = _decoder_linears(model)
  out = []
  for names, _ in linears:
    picked = [n for n in names if chosen(n)]
    if picked and len(picked) < len(names):
      raise AdapterError(f"target_modules={targets!r} selects {len(picked)} of the {len(names)} layers of "
                         f"{names[0].replace('.0.', '.*.')}, which a scanned decoder runs as one module: adapt "
                         f"all its layers or none, or set policy.scan_layers=False")
    out += picked
  if not out:
    existing = sorted({n.split(".")[-1] for names, _ in linears for n in names})
    raise AdapterError(f"target_modules={targets!r} matches no module; the decoder's linear modules are "
                       f"model.layers.<i>.{{self_attn,mlp}}.{{{','.join(existing)}}}")
  return out


def attach(model: CausalLM, spec: Spec, *, param_dtype=jnp.float32, seed: int = 0) -> list[str]:
  """Adds fresh adapters (A as PEFT draws it, B = 0: the model's outputs unchanged) in `param_dtype` to
  the modules `spec.target_modules` selects, in place; returns their Hugging Face names."""
  if spec.rank < 1:
    raise AdapterError(f"rank {spec.rank}: a LoRA rank is at least 1 (0 turns LoRA off)")
  chosen = set(module_names(model, spec.target_modules))
  if not isinstance(spec.target_modules, str):  # PEFT adapts the names that match in silence; a typo is worth a line
    unmatched = [t for t in spec.target_modules if not any(n == t or n.endswith("." + t) for n in chosen)]
    if unmatched:
      logging.warning("LoRA target_modules %s match no module of the decoder (adapting %s)", unmatched,
                      sorted({n.split(".")[-1] for n in chosen}))
  key = jax.random.key(seed)
  for i, (names, module) in enumerate(_decoder_linears(model)):
    if names[0] not in chosen:
      continue
    lead = module.kernel.shape[:-2]  # a scanned decoder's layer axis
    n_in, n_out = module.kernel.shape[-2:]
    # PEFT: kaiming_uniform(a=sqrt(5)) of A [r, in], i.e. uniform within 1 / sqrt(in)
    a_init = jax.nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=-2, out_axis=-1,
                                                  batch_axis=tuple(range(len(lead))))
    kernel_names = module.kernel.get_metadata().get("out_sharding") or (None,) * module.kernel.ndim
    module.lora = nnx.LoRA(
        n_in, spec.rank, n_out, dtype=module.dtype, param_dtype=param_dtype, rngs=nnx.Rngs(jax.random.fold_in(key, i)),
        a_initializer=lambda k, shape, dtype: a_init(k, (*lead, *shape), dtype),
        b_initializer=lambda k, shape, dtype: jnp.zeros((*lead, *shape), dtype),
        a_metadata={"out_sharding": (*kernel_names[:-1], "lora_rank"), "eager_sharding": False},
        b_metadata={"out_sharding": (*kernel_names[:-2], "lora_rank", kernel_names[-1]), "eager_sharding": False})
    module.lora_scale = spec.scale
  model.lora_spec = spec
  return sorted(chosen, key=_layer_order)


def _layer_order(name: str):
  return [int(p) if p.isdigit() else p for p in name.split(".")]


def spec_of(model: CausalLM) -> Spec | None:
  """The model's adapters' `Spec`; None without adapters."""
  return getattr(model, "lora_spec", None)


def merged(model: CausalLM) -> CausalLM:
  """A copy of `model` without adapters, each adapted kernel W + scale A B in W's dtype (the plain model a
  rollout or an export reads; traceable, e.g. under jit). A model without adapters is returned as it is."""
  if spec_of(model) is None:
    return model
  model = nnx.clone(model)  # new modules and variables over the same arrays
  for _, module in _decoder_linears(model):
    if module.lora is not None:
      w = module.kernel.get_value()
      delta = jnp.einsum("...ir,...ro->...io", module.lora.lora_a.get_value().astype(jnp.float32),
                         module.lora.lora_b.get_value().astype(jnp.float32))
      module.kernel.set_value((w.astype(jnp.float32) + module.lora_scale * delta).astype(w.dtype))
      del module.lora, module.lora_scale
  del model.lora_spec
  return model


# ---- PEFT files ----

def _tensors(model: CausalLM):
  """(PEFT name of A, PEFT name of B, module, layer index or None) of every adapter."""
  for names, module in _decoder_linears(model):
    if module.lora is None:
      continue
    for i, name in enumerate(names):
      layer = i if module.kernel.ndim == 3 else None
      yield f"{_PEFT_PREFIX}{name}.lora_A.weight", f"{_PEFT_PREFIX}{name}.lora_B.weight", module, layer


def is_identity(model: CausalLM) -> bool:
  """Whether the adapters change nothing (every B zero: fresh, or never updated)."""
  return not any(bool(jnp.any(module.lora.lora_b.get_value() != 0)) for _, _, module, _ in _tensors(model))


def save_peft(model: CausalLM, directory: str, base_model: str = "") -> None:
  """The model's adapters as PEFT writes them: adapter_config.json and adapter_model.safetensors (A as
  `lora_A.weight` [r, in], B as `lora_B.weight` [out, r], float32), loadable by `PeftModel.from_pretrained`
  onto the base model."""
  spec = spec_of(model)
  if spec is None:
    raise AdapterError("the model has no LoRA adapters to save")
  tensors = {}
  for name_a, name_b, module, layer in _tensors(model):
    a, b = (np.asarray(jax.device_get(v.get_value()), np.float32) for v in (module.lora.lora_a, module.lora.lora_b))
    if layer is not None:
      a, b = a[layer], b[layer]
    tensors[name_a], tensors[name_b] = np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)
  os.makedirs(directory, exist_ok=True)
  safetensors.numpy.save_file(tensors, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
  targets = ALL_LINEAR if spec.target_modules == "all-linear" else spec.target_modules
  targets = targets if isinstance(targets, str) else sorted(targets)
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": targets, "use_rslora": spec.rslora,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None, "use_dora": False}
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump(config, f, indent=2)


def read_spec(directory: str) -> Spec:
  """The `Spec` of a PEFT adapter directory; AdapterError for what tlt_jax does not train (DoRA, per-module
  ranks, trained biases or extra modules, a non-LoRA method)."""
  path = os.path.join(directory, CONFIG_FILE)
  try:
    with open(path) as f:
      c = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise AdapterError(f"{path}: not a PEFT adapter config ({e})") from None
  unsupported = {"peft_type": c.get("peft_type", "LORA") != "LORA", "use_dora": bool(c.get("use_dora")),
                 "rank_pattern": bool(c.get("rank_pattern")), "alpha_pattern": bool(c.get("alpha_pattern")),
                 "bias": c.get("bias", "none") != "none", "modules_to_save": bool(c.get("modules_to_save"))}
  if any(unsupported.values()):
    key = next(k for k, bad in unsupported.items() if bad)
    raise AdapterError(f"{path}: {key}={c.get(key)!r} is not supported (plain LoRA on linear layers only)")
  targets = c.get("target_modules")
  if not targets or "r" not in c:
    raise AdapterError(f"{path}: no r or target_modules")
  return Spec(int(c["r"]), float(c.get("lora_alpha", 8)), targets if isinstance(targets, str) else tuple(targets),
              bool(c.get("use_rslora", False)))


def load_peft(model: CausalLM, directory: str, *, param_dtype=jnp.float32) -> Spec:
  """Attaches the PEFT adapter in `directory` to `model` (in place): its spec, then its A and B;
  AdapterError naming the tensor for one that is missing or whose shape does not fit the model."""
  spec = read_spec(directory)
  attach(model, spec, param_dtype=param_dtype)
  path = os.path.join(directory, WEIGHTS_FILE)
  try:
    stored = safetensors.numpy.load_file(path)
  except (OSError, safetensors.SafetensorError) as e:
    raise AdapterError(f"{path}: {e}") from None
  values = {}
  for name_a, name_b, module, layer in _tensors(model):
    for name, var in ((name_a, module.lora.lora_a), (name_b, module.lora.lora_b)):
      want = var.get_value().shape[-2:][::-1]
      if name not in stored:
        raise AdapterError(f"{path}: no tensor {name} (target_modules selects it)")
      if stored[name].shape != want:
        raise AdapterError(f"{path}: {name} is {list(stored[name].shape)}, the model's needs {list(want)}: an "
                           f"adapter of another base model")
      values.setdefault(id(var), (var, []))[1].append(stored[name].T)
  for var, slices in values.values():
    value = np.stack(slices) if var.get_value().ndim == 3 else slices[0]
    var.set_value(jnp.asarray(value, param_dtype))
  return spec


def fingerprint(policy_dir: str) -> str:
  """sha256 of a Hugging Face directory's weight files (their bytes, in name order): which base model
  an adapter was trained on, checked when a LoRA run resumes."""
  h = hashlib.sha256()
  for name in sorted(f for f in os.listdir(policy_dir) if f.endswith(".safetensors")):
    h.update(name.encode())
    with open(os.path.join(policy_dir, name), "rb") as f:
      while chunk := f.read(1 << 24):
        h.update(chunk)
  return h.hexdigest()
