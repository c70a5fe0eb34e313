"""Hugging Face checkpoints in and out: `config.json` + (sharded) safetensors + tokenizer.

Loading streams tensor by tensor: every device reads only its own slice of each tensor straight
from the safetensors file onto its NamedSharding, so the model never exists twice on the host.
Our parameter paths mirror HF names; Linear kernels are stored transposed ([in, out]). A scanned
decoder's layer parameters are stacked ([L, ...]): layer i's tensor `model.layers.<i>.*` is slice i.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.flax
from absl import logging
from flax import nnx

from tlt_jax import files, sharding
from tlt_jax.models.config import ConfigError, ModelConfig
from tlt_jax.models.transformer import CausalLM

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_SAFETENSORS_DTYPES = {"F32", "BF16", "F16"}
_LEAF_NAMES = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# What `save_pretrained` writes (weights, config, a tokenizer's files): a directory holding
# nothing else is one it may replace.
_WRITTEN = ("config.json", "*.safetensors", _INDEX, "tokenizer*", "special_tokens_map.json", "added_tokens.json",
            "chat_template.*", "vocab.*", "merges.txt")


class CheckpointError(ValueError):
  """A checkpoint we cannot load; the message names the file and tensor."""


def hf_name(path: tuple) -> str:
  """Our parameter path -> HF tensor name: ('model', 'layers', 0, 'mlp', 'up_proj', 'kernel')
  -> 'model.layers.0.mlp.up_proj.weight'."""
  return ".".join(str(p) for p in path[:-1]) + "." + _LEAF_NAMES[path[-1]]


def hf_tensors(path: tuple, shape: tuple) -> list[tuple[str, int | None]]:
  """The HF tensors of one of our parameters, as (name, layer): the parameter itself (layer None),
  or, for a scanned decoder's stacked layer parameter ('model', 'layers', 'mlp', ...), one tensor
  per layer `i`, its slice `[i]`."""
  if path[:2] != ("model", "layers") or isinstance(path[2], int):
    return [(hf_name(path), None)]
  return [(hf_name((*path[:2], i, *path[2:])), i) for i in range(shape[0])]


def _dtype(name: Any, source: str):
  if name is None or not isinstance(name, str):
    return name
  if name not in DTYPES:
    raise CheckpointError(f"{source}: dtype {name!r} is not supported; use one of {sorted(DTYPES)}")
  return DTYPES[name]


def read_config(model_dir: str) -> tuple[ModelConfig, dict]:
  """The model config of a HF directory (and the raw config dict)."""
  if not os.path.isdir(model_dir):
    raise FileNotFoundError(f"model directory {model_dir!r} does not exist")
  path = os.path.join(model_dir, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found: a Hugging Face model directory needs config.json")
  with open(path, encoding="utf-8") as f:
    try:
      raw = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
      raise ConfigError(f"{path}: invalid JSON ({e})") from e
  return ModelConfig.from_hf(raw, source=path), raw


def _weight_files(model_dir: str) -> dict[str, str]:
  """Tensor name -> safetensors file, from the index of a sharded checkpoint or the single file."""
  index = os.path.join(model_dir, _INDEX)
  if os.path.isfile(index):
    with open(index, encoding="utf-8") as f:
      try:
        weight_map = json.load(f)["weight_map"]
      except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    files = {os.path.join(model_dir, v) for v in weight_map.values()}
    missing = sorted(p for p in files if not os.path.isfile(p))
    if missing:
      raise FileNotFoundError(f"{index} lists files that do not exist: {missing}")
    return {k: os.path.join(model_dir, v) for k, v in weight_map.items()}
  single = os.path.join(model_dir, _SINGLE)
  if not os.path.isfile(single):
    raise FileNotFoundError(f"{model_dir}: neither {_INDEX} nor {_SINGLE} found")
  with _open_safetensors(single) as f:
    return {k: single for k in f.keys()}


def _open_safetensors(path: str):
  """safetensors.safe_open, with a damaged file (truncated, not safetensors) named."""
  try:
    return safetensors.safe_open(path, framework="flax")
  except safetensors.SafetensorError as e:
    raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def checkpoint_dtype(model_dir: str) -> str:
  """The dtype a HF model directory's config.json says its weights are in (float32 if it says none)."""
  _, raw = read_config(model_dir)
  return jnp.dtype(_dtype(raw.get("torch_dtype") or raw.get("dtype") or "float32",
                          os.path.join(model_dir, "config.json"))).name


def from_pretrained(model_dir: str, dtype=None, mesh: jax.sharding.Mesh | None = None,
                    scan_layers: bool | None = None, param_dtype=None) -> CausalLM:
  """Loads a HF model directory into a `CausalLM`, sharded over `mesh` (default: one device).

  `dtype`, the compute dtype (a jnp dtype or 'float32' / 'bfloat16' / 'float16'), defaults to the
  checkpoint's; `param_dtype`, the weights' (e.g. float32 masters of a bfloat16 model), to `dtype`;
  `scan_layers` (`ModelConfig.scan_layers`) to the config's default (the command-line tools pass
  `cli.scan_layers`: unrolled on a CPU).
  """
  cfg, _ = read_config(model_dir)
  if scan_layers is not None:
    cfg = dataclasses.replace(cfg, scan_layers=scan_layers)
  dtype = _dtype(dtype, "dtype argument") or jnp.dtype(checkpoint_dtype(model_dir))
  param_dtype = _dtype(param_dtype, "param_dtype argument") or dtype
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype, param_dtype=param_dtype,
                                                                  rngs=nnx.Rngs(0))))
  if mesh is None:
    mesh = sharding.make_mesh({}, devices=jax.local_devices()[:1])
  files = _weight_files(model_dir)
  cpu = jax.local_devices(backend="cpu")[0]

  with contextlib.ExitStack() as stack:
    handles = {}

    def tensor(name, shape, transpose):
      """The open slice of tensor `name`, checked to hold a parameter (layer) of `shape`."""
      if name not in files:
        raise CheckpointError(f"{model_dir}: tensor {name!r} is missing from the checkpoint")
      if files[name] not in handles:
        handles[files[name]] = stack.enter_context(_open_safetensors(files[name]))
      found = handles[files[name]].get_slice(name)
      expected = tuple(shape[::-1] if transpose else shape)
      if tuple(found.get_shape()) != expected:
        raise CheckpointError(f"{files[name]}: tensor {name!r} has shape {tuple(found.get_shape())}, "
                              f"expected {expected}")
      if found.get_dtype() not in _SAFETENSORS_DTYPES:
        raise CheckpointError(f"{files[name]}: tensor {name!r} has dtype {found.get_dtype()}, "
                              f"supported: {sorted(_SAFETENSORS_DTYPES)}")
      return found

    def load(path, var):
      transpose = path[-1] == "kernel"
      names = hf_tensors(path, var.shape)
      stacked = names[0][1] is not None
      parts = [tensor(name, var.shape[1:] if stacked else var.shape, transpose) for name, _ in names]

      def read_one(part, index):
        with jax.default_device(cpu):
          return np.asarray(part[index[::-1]].T if transpose else part[index]).astype(param_dtype)

      def read(index):  # this device's block; of a stacked parameter, its layers' blocks stacked
        if stacked:
          return np.stack([read_one(part, index[1:]) for part in parts[index[0]]])
        return read_one(parts[0], index)

      target = sharding.variable_sharding(var, mesh)
      return var.replace(jax.make_array_from_callback(var.shape, target, read))

    flat = nnx.to_flat_state(abstract)
    state = nnx.from_flat_state([(p, load(p, v)) for p, v in flat])
  unused = set(files) - {name for p, v in flat for name, _ in hf_tensors(p, v.shape)}
  if unused:
    logging.info("%s: %d checkpoint tensors unused (e.g. %s)", model_dir, len(unused), sorted(unused)[0])
  return nnx.merge(graphdef, state)


# tokenizer_config.json's class of a tokenizer that is its tokenizer.json and nothing else (transformers 5
# names it TokenizersBackend, 4 PreTrainedTokenizerFast).
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: str):
  """The directory's tokenizer through `transformers.AutoTokenizer`, or None if it has none.

  A generic one (`_GENERIC_TOKENIZERS`, e.g. the tiny world's character tokenizer) loads as that
  class: AutoTokenizer would load it as the model type's own class (a `qwen2` directory's as
  Qwen2Tokenizer, whose byte-level pre-tokenizer mangles it), whatever tokenizer_config.json says.
  """
  names = [f for f in ("tokenizer.json", "tokenizer_config.json") if os.path.isfile(os.path.join(model_dir, f))]
  if not names:
    return None
  import transformers  # pylint: disable=g-import-not-at-top  (heavy; only when a tokenizer exists)
  try:
    if "tokenizer.json" in names and _tokenizer_class(model_dir) in _GENERIC_TOKENIZERS:
      return transformers.PreTrainedTokenizerFast.from_pretrained(model_dir)
    return transformers.AutoTokenizer.from_pretrained(model_dir)
  except Exception as e:  # pylint: disable=broad-exception-caught
    # transformers raises whatever its parsers do (JSONDecodeError, tokenizers' Exception, OSError).
    raise CheckpointError(f"{model_dir}: cannot load its tokenizer ({' / '.join(names)}): "
                          f"{type(e).__name__}: {e}") from None


def _tokenizer_class(model_dir: str) -> str | None:
  """tokenizer_config.json's `tokenizer_class` (None: no such file or key; a broken file is AutoTokenizer's to name)."""
  try:
    with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, ValueError):
    return None
  return config.get("tokenizer_class") if isinstance(config, dict) else None


def is_saved_model(path: str) -> bool:
  """Whether the directory `path` holds a model as `save_pretrained` writes it and nothing else."""
  names = os.listdir(path)
  return "config.json" in names and all(any(fnmatch.fnmatch(n, p) for p in _WRITTEN) for n in names)


def save_pretrained(model: CausalLM, out_dir: str, tokenizer=None, max_shard_bytes: int = 4 << 30,
                    dtype=None) -> None:
  """Writes `model` (and `tokenizer`) as a HF directory that `transformers` loads.

  Tensors are in `dtype` (default: the weights' own; e.g. a bfloat16 model of float32 masters) and go
  into safetensors files of at most `max_shard_bytes` (with an index when several).
  The directory is written under a temporary name and renamed, so a crash leaves no half model; it
  replaces only an empty directory or a model written like this one (`is_saved_model`).
  """
  cfg = model.config
  params = [(p, v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
  # (name, transpose, value, layer): a stacked layer parameter's tensors are its slices. In the
  # names' natural order (layer 2 before layer 10), whatever the layer form: a layer's tensors stay
  # together in the shards.
  natural = lambda item: tuple((0, int(x), "") if x.isdigit() else (1, 0, x) for x in item[0].split("."))
  flat = sorted(((name, p[-1] == "kernel", v, layer) for p, v in params for name, layer in hf_tensors(p, v.shape)),
                key=natural)
  dtype = jnp.dtype(_dtype(dtype, "dtype argument") or flat[0][2].dtype)
  shards, size = [[]], 0
  for item in flat:
    nbytes = item[2].size * dtype.itemsize // (1 if item[3] is None else item[2].shape[0])
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(item)
    size += nbytes
  with files.atomic_directory(out_dir, "a model directory as save_pretrained writes it", is_saved_model) as tmp:
    cpu = jax.local_devices(backend="cpu")[0]
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = _SINGLE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      tensors = {}
      for name, transpose, value, layer in shard:
        host = np.asarray(jax.device_get(value if layer is None else value[layer])).astype(dtype)
        tensors[name] = jax.device_put(host.T if transpose else host, cpu)
        weight_map[name] = fname
      safetensors.flax.save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
    if len(shards) > 1:
      total = sum(v.size * dtype.itemsize for _, v in params)
      with open(os.path.join(tmp, _INDEX), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": int(total)}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
      json.dump({**cfg.to_hf(), "torch_dtype": dtype.name}, f, indent=2)
    if tokenizer is not None:
      tokenizer.save_pretrained(tmp)
