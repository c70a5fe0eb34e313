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
Writes steps.csv (one row per trainer and step), curves.png (reward and step time per step) and
summary.json, and prints the summary: step-time ratios (`--reference` / arm, first step excluded:
it compiles) and the mean reward of each over the run.
"""

from __future__ import annotations

import csv
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
from absl import app, flags  # pylint: disable=wrong-import-position
from ml_collections import config_flags  # pylint: disable=wrong-import-position

import starting_point  # pylint: disable=wrong-import-position
from tlt_jax import config as config_lib  # pylint: disable=wrong-import-position
from tlt_jax.rl import bootstrap  # pylint: disable=wrong-import-position
from tlt_jax.rl.trainer import Trainer  # pylint: disable=wrong-import-position

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(os.path.dirname(__file__), "..", "configs",
                                                                 "tiny.py"), "Experiment config.")
_STEPS = flags.DEFINE_integer("steps", 6, "RL steps per trainer.")
_OUT = flags.DEFINE_string("out", "runs/end_to_end", "Output directory.")

SUFFIX = ("s4_1_5", "s6_3_10")  # the suffix arms' strategies (no drafter model)
ARMS = {"tlt": {"rollout.speculative": True, "rollout.tlt.enabled": True},
        "frozen": {"rollout.speculative": True, "rollout.tlt.enabled": False},
        "baseline": {"rollout.speculative": False},
        "tlt_waves": {"rollout.speculative": True, "rollout.tlt.enabled": True, "rollout.engine.refill": False},
        "baseline_waves": {"rollout.speculative": False, "rollout.engine.refill": False},
        "suffix": {"rollout.speculative": True, "rollout.drafter": "suffix", "rollout.strategies": SUFFIX},
        "suffix_history": {"rollout.speculative": True, "rollout.drafter": "suffix", "rollout.strategies": SUFFIX,
                           "rollout.engine.suffix_history_len": 1024}}
_ARMS = flags.DEFINE_list("arms", ["tlt", "frozen", "baseline"], f"Trainers to step side by side, of {list(ARMS)}.")
_REFERENCE = flags.DEFINE_string("reference", "baseline", "The arm the step-time ratios divide (one of --arms).")
KEYS = ("reward/mean", "reward/accuracy", "response_length/median", "response_length/max", "time/step_s",
        "time/rollout_s", "time/train_s", "rollout/tail_share", "rollout/accept_len", "rollout/refills",
        "rollout/idle_slot_fraction")


def main(argv):
  del argv
  out, arms, reference = _OUT.value, _ARMS.value, _REFERENCE.value
  unknown = [a for a in arms if a not in ARMS]
  if unknown or not arms:
    raise app.UsageError(f"--arms={','.join(arms)}: unknown {unknown}; known: {list(ARMS)}")
  if reference not in arms:
    raise app.UsageError(f"--reference={reference}: not one of --arms={','.join(arms)}")
  os.makedirs(out, exist_ok=True)
  config_lib.setup_devices(_CONFIG.value)
  policy_dir, drafter_dir = starting_point.policy_and_drafter(_CONFIG.value, out)
  trainers = {}
  for name in arms:
    overrides = ARMS[name]
    c = _CONFIG.value.copy_and_resolve_references()
    c.steps = _STEPS.value
    c.update_from_flattened_dict(overrides)
    c.checkpoint.every = 10**6  # no checkpoints in a timing run (the final one is written)
    c.eval.every = 0  # nor held-out evaluations (their engine would compile in the first step)
    c.policy.path, c.drafter.path = policy_dir, drafter_dir  # all start from the same; each logs into its own
    c.workdir = starting_point.fresh_workdir(os.path.join(out, name))
    trainers[name] = Trainer(c, *bootstrap.load(c))
  rows = []
  for step in range(_STEPS.value):
    for name, trainer in trainers.items():
      record = trainer.run_step()
      rows.append({"trainer": name, "step": step + 1, **{k: record.get(k, float("nan")) for k in KEYS}})
      print(json.dumps(rows[-1]))
  for trainer in trainers.values():
    trainer.close()

  with open(os.path.join(out, "steps.csv"), "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  series = {name: [r for r in rows if r["trainer"] == name] for name in trainers}
  timed = lambda name, key: float(np.mean([r[key] for r in series[name][1:] or series[name]]))
  summary = {
      "steps": _STEPS.value,
      "step_s": {name: timed(name, "time/step_s") for name in trainers},
      "rollout_s": {name: timed(name, "time/rollout_s") for name in trainers},
      "step_time_ratio": {name: timed(reference, "time/step_s") / timed(name, "time/step_s") for name in trainers},
      "rollout_time_ratio": {name: timed(reference, "time/rollout_s") / timed(name, "time/rollout_s")
                             for name in trainers},
      "reward_mean": {name: float(np.mean([r["reward/mean"] for r in series[name]])) for name in trainers},
      "reward_first_last": {name: (series[name][0]["reward/mean"], series[name][-1]["reward/mean"])
                            for name in trainers},
      # Over the steps where SD ran (the bandit may play SD off for a whole rollout: 0 there).
      "accept_len": {name: float(np.mean([r["rollout/accept_len"] for r in series[name] if r["rollout/accept_len"] > 0]
                                         or [0.0])) for name in trainers if ARMS[name]["rollout.speculative"]},
  }
  with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)

  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for name, rs in series.items():
    steps = [r["step"] for r in rs]
    axes[0].plot(steps, [r["reward/mean"] for r in rs], marker="o", label=name)
    axes[1].plot(steps, [r["time/step_s"] for r in rs], marker="o", label=name)
  axes[0].set(xlabel="RL step", ylabel="mean reward", title="reward")
  axes[1].set(xlabel="RL step", ylabel="seconds", title="step time", yscale="log")
  for ax in axes:
    ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "curves.png"), dpi=120)
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  app.run(main)
