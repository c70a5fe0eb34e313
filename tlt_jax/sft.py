"""Supervised warm start of the tiny policy on worked solutions, then a held-out evaluation.

  python -m tlt_jax.sft [--config=configs/tiny.py] [--config.sft.steps=300 ...]

Writes `<workdir>/policy` (a Hugging Face model directory with the tokenizer: `from_pretrained`
and `transformers` both load it) and `<workdir>/sft_report.json`: held-out accuracy by
difficulty and the response-length distribution of greedy and temperature-1 samples
(tlt_jax.rl.sft), and prints the report.
"""

from __future__ import annotations

import json

from tlt_jax import cli
from tlt_jax import config as config_lib
from tlt_jax.rl import sft
from tlt_jax.rl import checks

_CONFIG = cli.define_config(config_lib.__file__)  # its get_config(): the tiny world


def main(argv):
  del argv
  config = cli.config_value(_CONFIG)
  try:
    checks.check(config)
  except ValueError as e:
    cli.fail(str(e))
  print(json.dumps(sft.run(config), indent=2))


if __name__ == "__main__":
  cli.run(main)
