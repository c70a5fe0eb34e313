"""RL trainers that differ only by their rollouts (arms), stepped alternately in one process so that all
see the same machine conditions (experiments/end_to_end.py, experiments/accelerator.py)."""

from __future__ import annotations

import json
import os

import numpy as np

import starting_point
from tlt_jax.rl import bootstrap
from tlt_jax.rl.trainer import Trainer

SUFFIX = ("s4_1_5", "s6_3_10")  # the suffix arms' strategies (no drafter model)
ARMS = {"tlt": {"rollout.speculative": True, "rollout.tlt.enabled": True},
        "frozen": {"rollout.speculative": True, "rollout.tlt.enabled": False},
        "baseline": {"rollout.speculative": False},
        "tlt_waves": {"rollout.speculative": True, "rollout.tlt.enabled": True, "rollout.engine.refill": False},
        "baseline_waves": {"rollout.speculative": False, "rollout.engine.refill": False},
        "suffix": {"rollout.speculative": True, "rollout.drafter": "suffix", "rollout.strategies": SUFFIX},
        "suffix_history": {"rollout.speculative": True, "rollout.drafter": "suffix", "rollout.strategies": SUFFIX,
                           "rollout.engine.suffix_history_len": 1024}}
KEYS = ("reward/mean", "reward/accuracy", "response_length/median", "response_length/p90", "response_length/max",
        "time/step_s", "time/rollout_s", "time/train_s", "rollout/tail_share", "rollout/sd_share",
        "rollout/accept_len", "rollout/refills", "rollout/idle_slot_fraction", "rollout/compilations",
        "rollout/decode_s", "rollout/tool_append_s", "rollout/tool_wait_s", "tools/calls_per_response")


def check_arms(arms, reference: str) -> None:
  """ValueError naming an unknown arm, or a reference that is not one of them."""
  unknown = [a for a in arms if a not in ARMS]
  if unknown or not arms:
    raise ValueError(f"--arms={','.join(arms)}: unknown {unknown}; known: {list(ARMS)}")
  if reference not in arms:
    raise ValueError(f"--reference={reference}: not one of --arms={','.join(arms)}")


def trainers(config, arms, steps: int, out: str, policy_dir: str, drafter_dir: str) -> dict[str, Trainer]:
  """One trainer per arm from `config` with the arm's keys, all from the same policy and drafter, each
  logging into <out>/<arm> (emptied first), without checkpoints or held-out evaluations on the way."""
  made = {}
  for name in arms:
    c = config.copy_and_resolve_references()
    c.steps = steps
    c.update_from_flattened_dict(ARMS[name])
    c.checkpoint.every = 10**6  # no checkpoints in a timing run (the final one is written)
    c.eval.every = 0  # nor held-out evaluations (their engine would compile in the first step)
    c.policy.path, c.drafter.path = policy_dir, drafter_dir  # all start from the same; each logs into its own
    c.workdir = starting_point.fresh_workdir(os.path.join(out, name))
    made[name] = Trainer(c, *bootstrap.load(c))
  return made


def step_alternately(arms: dict[str, Trainer], steps: int) -> list[dict]:
  """`steps` steps of each trainer, one trainer's step after the other's; one row (KEYS) per trainer and
  step, each printed as it comes. Closes the trainers."""
  rows = []
  try:
    for step in range(steps):
      for name, trainer in arms.items():
        record = trainer.run_step()
        rows.append({"trainer": name, "step": step + 1, **{k: record.get(k, float("nan")) for k in KEYS}})
        print(json.dumps(rows[-1]), flush=True)
  finally:
    for trainer in arms.values():
      trainer.close()
  return rows


def summary(rows: list[dict], reference: str) -> dict:
  """Means over the steps after the first (it compiles) of each trainer's step and rollout time, their
  ratios (`reference` / trainer), the mean reward over all steps, whether every arm got the same rewards
  and response lengths at every step (lossless rollouts sample the same tokens), and the acceptance
  length where SD ran."""
  names = list(dict.fromkeys(r["trainer"] for r in rows))
  series = {name: [r for r in rows if r["trainer"] == name] for name in names}
  outcome = lambda r: tuple(r[k] for k in ("reward/mean", "response_length/median", "response_length/p90",
                                           "response_length/max"))
  timed = lambda name, key: float(np.mean([r[key] for r in series[name][1:] or series[name]]))
  return {
      "steps": len(series[names[0]]),
      "step_s": {name: timed(name, "time/step_s") for name in names},
      "rollout_s": {name: timed(name, "time/rollout_s") for name in names},
      "step_time_ratio": {name: timed(reference, "time/step_s") / timed(name, "time/step_s") for name in names},
      "rollout_time_ratio": {name: timed(reference, "time/rollout_s") / timed(name, "time/rollout_s")
                             for name in names},
      "reward_mean": {name: float(np.mean([r["reward/mean"] for r in series[name]])) for name in names},
      "reward_first_last": {name: (series[name][0]["reward/mean"], series[name][-1]["reward/mean"]) for name in names},
      "rewards_identical": all(len({outcome(r) for r in rows if r["step"] == step}) == 1
                               for step in {r["step"] for r in rows}),
      # Over the steps where SD ran (the bandit may play SD off for a whole rollout: 0 there).
      "accept_len": {name: float(np.mean([r["rollout/accept_len"] for r in series[name] if r["rollout/accept_len"] > 0]
                                         or [0.0])) for name in names if ARMS[name]["rollout.speculative"]},
  }
