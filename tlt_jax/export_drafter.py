"""Export a trained drafter as an EAGLE-format checkpoint for serving engines.

  python -m tlt_jax.export_drafter --model=POLICY_DIR --drafter=DRAFTER_DIR --output=DIR [--overwrite]

--model is the (final) policy's Hugging Face directory, whose embedding and lm_head the
drafter reads; --drafter a tlt_jax drafter checkpoint (`train_drafter`, or the online drafter trainer's).
Writes DIR/model.safetensors + DIR/config.json with the tensor names listed in
`tlt_jax.drafter.export` and prints a JSON summary. DIR must not be an input or hold one; an
existing non-empty DIR is replaced only when it is an EAGLE export and --overwrite is given.
"""

from __future__ import annotations

import json
import math
import os

from absl import flags

from tlt_jax import cli
from tlt_jax.drafter import checkpoint, export
from tlt_jax.models import hf

_MODEL = flags.DEFINE_string("model", None, "Target (policy) Hugging Face model directory.", required=True)
_DRAFTER = flags.DEFINE_string("drafter", None, "tlt_jax drafter checkpoint directory.", required=True)
_OUTPUT = flags.DEFINE_string("output", None, "Directory to write the EAGLE checkpoint to.", required=True)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the EAGLE export already at --output (nothing else is "
                               "ever replaced).")


def main(argv):
  del argv
  cli.check_output("output", _OUTPUT.value, {"model": _MODEL.value, "drafter": _DRAFTER.value},
                   kind="an EAGLE export", is_own=export.is_export, overwrite=_OVERWRITE.value)
  with cli.named("model", _MODEL.value):
    target_config, _ = hf.read_config(_MODEL.value)
  with cli.named("drafter", _DRAFTER.value):
    drafter = checkpoint.load_drafter(_DRAFTER.value, target_config)
    export.check_exportable(drafter)
  with cli.named("model", _MODEL.value):
    target = hf.from_pretrained(_MODEL.value)
  shapes = export.export_eagle(target, drafter, _OUTPUT.value)
  print(json.dumps({"output": os.path.abspath(_OUTPUT.value), "tensors": len(shapes),
                    "drafter_params": sum(math.prod(s) for k, s in shapes.items()
                                          if k not in ("embed_tokens.weight", "lm_head.weight"))}))


if __name__ == "__main__":
  cli.run(main)
