"""Chat prompts for a real model: reasoning-gym questions of several families, or open-ended requests
(letters, stories, explanations), as a prompts JSONL file.

  python experiments/chat_prompts.py --out=runs/smollm2/train_prompts.jsonl --size=512 --seed=0
  python experiments/chat_prompts.py --open --out=runs/open/train.jsonl --size=256 --seed=0

Writes {"prompt": question} lines, the families taken in turn (question i of a family depends on
(family, seed, i) only), for `python -m tlt_jax.train_drafter --prompts=...` and
`python -m tlt_jax.bench --prompts=...`. The default families are word problems, equations and
puzzles to which a small instruct model answers at lengths from a few tokens to hundreds (a long
tail). Use another --seed for held-out prompts. `--open` writes requests a chat model answers at length
(the kind of prompt a drafter trained on reasoning-gym has not seen), each a template filled from word
lists (`open_requests.py`): --seed=0 draws from 7/8 of the combinations, any other seed from the other 1/8 (held out).
"""

from __future__ import annotations

import json
import os

import reasoning_gym
from absl import app, flags

from open_requests import open_requests

FAMILIES = ("gsm_symbolic", "simple_equations", "basic_arithmetic", "letter_counting", "family_relationships",
            "time_intervals", "spell_backward", "sentence_reordering", "number_sorting", "prime_factorization")

_OUT = flags.DEFINE_string("out", None, "Output JSONL file.", required=True)
_SIZE = flags.DEFINE_integer("size", 512, "Prompts to write.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of every family's questions.")
_FAMILIES = flags.DEFINE_list("families", list(FAMILIES), "reasoning-gym dataset names, taken in turn.")
_OPEN = flags.DEFINE_bool("open", False, "Open-ended requests (letters, stories, explanations, ...) instead of "
                          "reasoning-gym questions; --families is then unused.")


def questions(families, size: int, seed: int) -> list[str]:
  per_family = -(-size // len(families))
  datasets = {f: reasoning_gym.create_dataset(f, size=per_family, seed=seed) for f in families}
  return [datasets[families[i % len(families)]][i // len(families)]["question"] for i in range(size)]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    rows = open_requests(_SIZE.value, _SEED.value) if _OPEN.value else questions(_FAMILIES.value, _SIZE.value,
                                                                                   _SEED.value)
  except ValueError as e:  # reasoning-gym names an unknown family, or too few open requests
    raise SystemExit(f"error: {e}" if _OPEN.value else f"error: --families: {e}") from None
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w", encoding="utf-8") as f:
    f.writelines(json.dumps({"prompt": q}) + "\n" for q in rows)
  print(json.dumps({"out": os.path.abspath(_OUT.value), "prompts": len(rows),
                    "families": "open" if _OPEN.value else _FAMILIES.value}))


if __name__ == "__main__":
  app.run(main)
