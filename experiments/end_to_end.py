"""End to end: RL step time and reward curves of TLT vs SD with a frozen drafter vs plain rollouts.

  python experiments/end_to_end.py [--config=configs/tiny.py] [--config.workdir=runs/tiny] [--steps=6] \
      --out=runs/end_to_end

  # refill vs waves (continuous batching), with a rollout of several waves per group:
  python experiments/end_to_end.py --config.workdir=runs/tiny --config.rollout.engine.batch_buckets="(1,2,4,8,16,32)" \
      --arms=tlt,tlt_waves,baseline,baseline_waves --reference=baseline_waves --out=runs/end_to_end_refill

Three trainers from the same config, the same SFT policy and the same warmed-up drafter (the
config's workdir's, else built into <out>/init), step alternately in one process, so all see the
same machine conditions (the paper's Fig 11 / Fig 7 arms):
  tlt       tail SD + bandit, the drafter spot-trained on idle rollout groups;
  frozen    the same rollouts with `rollout.tlt.enabled=False` (the warm-up drafter never changes);
  baseline  `rollout.speculative=False`: plain decoding, data-parallel over the same devices;
and, by `--arms`, `tlt_waves` / `baseline_waves`: the same with `rollout.engine.refill=False` (a group's rows
beyond its largest batch bucket run in consecutive waves instead of refilling finished rows' slots),
`suffix`: tail SD with suffix drafts alone (`rollout.drafter=suffix`, no drafter model), and
`suffix_history`: the same with each prompt's responses of earlier steps in its bank (with a small
`--config.data.size` prompts come back every few steps: epochs).
Writes steps.csv (one row per trainer and step), curves.png (tlt_jax.report.figure: reward, response
length, rollout time and acceptance per step, one line per arm) and
summary.json, and prints the summary: step- and rollout-time ratios (`--reference` / arm, first step
excluded: it compiles), the mean reward of each over the run and whether all arms got the same rewards
and response lengths at every step (`rewards_identical`: lossless rollouts sample the same tokens).
"""

from __future__ import annotations

import csv
import json
import os

from absl import app, flags
from ml_collections import config_flags

import side_by_side
import starting_point
from tlt_jax import distributed
from tlt_jax import report

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(os.path.dirname(__file__), "..", "configs",
                                                                 "tiny.py"), "Experiment config.")
_STEPS = flags.DEFINE_integer("steps", 6, "RL steps per trainer.")
_OUT = flags.DEFINE_string("out", "runs/end_to_end", "Output directory.")
_ARMS = flags.DEFINE_list("arms", ["tlt", "frozen", "baseline"],
                          f"Trainers to step side by side, of {list(side_by_side.ARMS)}.")
_REFERENCE = flags.DEFINE_string("reference", "baseline", "The arm the step-time ratios divide (one of --arms).")


def main(argv):
  del argv
  out, arms, reference = _OUT.value, _ARMS.value, _REFERENCE.value
  try:
    side_by_side.check_arms(arms, reference)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  os.makedirs(out, exist_ok=True)
  distributed.setup_devices(_CONFIG.value)
  policy_dir, drafter_dir = starting_point.policy_and_drafter(_CONFIG.value, out)
  rows = side_by_side.step_alternately(
      side_by_side.trainers(_CONFIG.value, arms, _STEPS.value, out, policy_dir, drafter_dir), _STEPS.value)

  with open(os.path.join(out, "steps.csv"), "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  summary = side_by_side.summary(rows, reference)
  with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)

  report.figure({name: [r for r in rows if r["trainer"] == name] for name in arms}, os.path.join(out, "curves.png"))
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  app.run(main)
