"""Export a trained drafter as an EAGLE-format checkpoint for serving engines.

  python -m tlt_jax.export_drafter --model=POLICY_DIR --drafter=DRAFTER_DIR --output=DIR

--model is the (final) policy's Hugging Face directory, whose embedding and lm_head the
drafter reads; --drafter a tlt_jax drafter checkpoint (`train_drafter`, or the spot trainer's).
Writes DIR/model.safetensors + DIR/config.json with the tensor names listed in
`tlt_jax.drafter.export` and prints a JSON summary.
"""

from __future__ import annotations

import json
import math
import os
import sys

from absl import app, flags

from tlt_jax.drafter import checkpoint, export
from tlt_jax.models import hf

_MODEL = flags.DEFINE_string("model", None, "Target (policy) Hugging Face model directory.", required=True)
_DRAFTER = flags.DEFINE_string("drafter", None, "tlt_jax drafter checkpoint directory.", required=True)
_OUTPUT = flags.DEFINE_string("output", None, "Directory to write the EAGLE checkpoint to.", required=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    target_config, _ = hf.read_config(_MODEL.value)
    drafter = checkpoint.load_drafter(_DRAFTER.value, target_config)
    shapes = export.export_eagle(hf.from_pretrained(_MODEL.value), drafter, _OUTPUT.value)
  except (FileNotFoundError, ValueError) as e:
    sys.exit(f"error: {e}")
  print(json.dumps({"output": os.path.abspath(_OUTPUT.value), "tensors": len(shapes),
                    "drafter_params": sum(math.prod(s) for k, s in shapes.items()
                                          if k not in ("embed_tokens.weight", "lm_head.weight"))}))


if __name__ == "__main__":
  app.run(main)
