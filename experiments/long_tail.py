"""The long tail of RL rollouts (the paper's motivation): response lengths, the tail's share of time, idle devices.

  python experiments/long_tail.py [--config=configs/tiny.py] [--config.workdir=runs/tiny] [--steps=4] \\
      [--threshold=16] --out=runs/long_tail

A few RL steps of the config's recipe with plain decoding on TLT's layout (`rollout.groups`
data-parallel groups; speculation may switch on only for a group's last row,
`rollout.engine.sd_max_batch=1`, the least the config allows) and no spot training
(`rollout.tlt.enabled=False`), so devices whose group has finished sit idle until the last group is
done. The policy (and drafter, whose engines it feeds) are the config's workdir's, else
built into <out>/init. Per step it records every response length, the share of decode time spent
with at most --threshold active rows (from the engines' per-segment records) and the idle
device-seconds (`spot/idle_device_s`) as a share of the rollout's device-seconds. Writes
lengths.csv, steps.csv, long_tail.png and summary.json to --out and prints the summary.

Then waves vs refill: one plain rollout of a group's share of a step's prompts with the trained
policy and the group engine's config, its largest bucket cut to 1/--waves of the rows, run in
waves (each waits for its longest row) and with refill (finished rows' slots take waiting rows),
each timed after a warm-up. The plot's last panel is the batch's occupancy over time in both;
the summary gains their tokens/s, idle slot fraction and tail share.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
from absl import app, flags  # pylint: disable=wrong-import-position
from flax import nnx  # pylint: disable=wrong-import-position
from ml_collections import config_flags  # pylint: disable=wrong-import-position

import starting_point  # pylint: disable=wrong-import-position
from tlt_jax import distributed  # pylint: disable=wrong-import-position
from tlt_jax.rl import bootstrap  # pylint: disable=wrong-import-position
from tlt_jax.rl.trainer import Trainer  # pylint: disable=wrong-import-position
from tlt_jax.rollout.engine import Engine  # pylint: disable=wrong-import-position

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(os.path.dirname(__file__), "..", "configs",
                                                                 "tiny.py"), "Experiment config.")
_STEPS = flags.DEFINE_integer("steps", 4, "RL steps.")
_THRESHOLD = flags.DEFINE_integer("threshold", 16, "Active rows (per group) at or below which a segment is tail.")
_OUT = flags.DEFINE_string("out", "runs/long_tail", "Output directory.")
_WAVES = flags.DEFINE_integer("waves", 4, "Waves vs refill: the largest bucket is 1/waves of the rollout's rows.",
                              lower_bound=2)


def record_rollouts(engines, sink: list) -> None:
  """Appends (group, Rollout) for every rollout the engines return: per-segment active rows and seconds."""
  for g, engine in enumerate(engines):
    def recorded(*args, _generate=engine.generate, _g=g, **kwargs):
      rollout = _generate(*args, **kwargs)
      sink.append((_g, rollout))
      return rollout
    engine.generate = recorded


def step_stats(rollouts, threshold: int) -> dict:
  decode = sum(s.seconds for _, r in rollouts for s in r.metrics.segments)
  tail = sum(s.seconds for _, r in rollouts for s in r.metrics.segments if s.active_rows <= threshold)
  tail_tokens = sum(s.tokens for _, r in rollouts for s in r.metrics.segments if s.active_rows <= threshold)
  tokens = sum(r.metrics.tokens for _, r in rollouts)
  return {"decode_s": decode, "tail_time_share": tail / max(decode, 1e-9),
          "tail_token_share": tail_tokens / max(tokens, 1)}


def timeline(rollout) -> tuple[np.ndarray, np.ndarray]:
  """(seconds since the rollout began, active rows) at each segment's start, and at the last one's end."""
  starts = rollout.metrics.prefill_s + np.cumsum([0.0] + [s.seconds for s in rollout.metrics.segments])
  rows = [s.active_rows for s in rollout.metrics.segments]
  return starts, np.asarray(rows + rows[-1:])


def waves_and_refill(trainer, prompts, num_samples: int, waves: int) -> dict:
  """mode -> the timed plain rollout of `prompts` with group 0's policy and engine config, its largest
  bucket cut to 1/`waves` of the rows, run in waves or with refill (after a warm-up each)."""
  e = trainer.rollout.engines[0]
  model = nnx.merge(e.steps.graphdef, e.params)
  largest = max(1, 1 << ((len(prompts) * num_samples // waves).bit_length() - 1))
  out = {}
  for mode in ("waves", "refill"):
    config = dataclasses.replace(e.config, strategies=(), refill=mode == "refill",
                                 batch_buckets=tuple(b for b in e.config.batch_buckets if b <= largest))
    engine = Engine(model, config, e.sampling, mesh=e.mesh)
    engine.generate(prompts, num_samples)  # compiles
    out[mode] = engine.generate(prompts, num_samples)
  return out


def plot(lengths, steps, last, threshold, compared, path):
  fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
  axes[0].boxplot([lengths[k] for k in sorted(lengths)], whis=(0, 100))
  axes[0].set(xlabel="RL step", ylabel="response length (tokens)", yscale="log",
              title="response lengths (whiskers: min-max)")
  for g, rollout in last:
    t, rows = timeline(rollout)
    axes[1].step(t, rows, where="post", label=f"group {g}")
  axes[1].axhline(threshold, color="gray", ls=":", label=f"{threshold} rows")
  axes[1].set(xlabel="seconds", ylabel="active rows", yscale="log", title="active rows, last step")
  axes[1].legend()
  ks = [s["step"] for s in steps]
  axes[2].plot(ks, [s["tail_time_share"] for s in steps], "o-", label=f"decode time with <= {threshold} rows")
  axes[2].plot(ks, [s["idle_share"] for s in steps], "s--", label="idle device time (no spot training)")
  axes[2].set(xlabel="RL step", xticks=ks, ylabel="share", ylim=(0, 1), title="the tail's cost")
  axes[2].legend()
  for mode, rollout in compared.items():
    t, rows = timeline(rollout)
    axes[3].step(t, rows, where="post", label=f"{mode}: {rollout.metrics.tokens_per_s:.0f} tokens/s")
  axes[3].set(xlabel="seconds", ylabel="active rows", title="batch occupancy: waves vs refill")
  axes[3].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main(argv):
  del argv
  out = _OUT.value
  os.makedirs(out, exist_ok=True)
  distributed.setup_devices(_CONFIG.value)
  c = _CONFIG.value.copy_and_resolve_references()
  c.policy.path, c.drafter.path = starting_point.policy_and_drafter(c, out)
  c.steps = _STEPS.value
  c.rollout.speculative, c.rollout.engine.sd_max_batch, c.rollout.tlt.enabled = True, 1, False
  c.checkpoint.every, c.eval.every = 10**6, 0  # a measuring run: no periodic checkpoints, no held-out evaluation
  c.workdir = starting_point.fresh_workdir(os.path.join(out, "rl"))
  trainer = Trainer(c, *bootstrap.load(c))
  rollouts = []
  record_rollouts(trainer.rollout.engines, rollouts)
  lengths, steps = {}, []
  try:
    for step in range(1, _STEPS.value + 1):
      rollouts.clear()
      record = trainer.run_step()
      lengths[step] = [len(s.tokens) for _, r in rollouts for s in r.samples]
      device_s = record["spot/wall_s"] * len(trainer.rollout.meshes) * trainer.rollout.meshes[0].size
      steps.append({"step": step, "rows": len(lengths[step]), "median_len": float(np.median(lengths[step])),
                    "p90_len": float(np.percentile(lengths[step], 90)), "max_len": int(max(lengths[step])),
                    **step_stats(rollouts, _THRESHOLD.value), "idle_device_s": record["spot/idle_device_s"],
                    "idle_share": record["spot/idle_device_s"] / max(device_s, 1e-9),
                    "rollout_s": record["time/rollout_s"], "reward": record["reward/mean"]})
      print(json.dumps(steps[-1]), flush=True)
    last = sorted(rollouts, key=lambda x: x[0])
    share = c.rollout.prompts_per_step // c.rollout.groups
    compared = waves_and_refill(trainer, [ex.prompt_ids for ex in trainer.prompts.examples[:share]],
                                c.rollout.num_samples, _WAVES.value)
  finally:
    trainer.close()

  with open(os.path.join(out, "lengths.csv"), "w", newline="", encoding="utf-8") as f:
    writer = csv.writer(f)
    writer.writerow(["step", "length"])
    writer.writerows((k, n) for k in sorted(lengths) for n in lengths[k])
  with open(os.path.join(out, "steps.csv"), "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=list(steps[0]))
    writer.writeheader()
    writer.writerows(steps)
  plot(lengths, steps, last, _THRESHOLD.value, compared, os.path.join(out, "long_tail.png"))
  timed = steps[1:] or steps  # the first step compiles
  every = np.concatenate([lengths[k] for k in lengths])
  summary = {"steps": _STEPS.value, "threshold": _THRESHOLD.value, "groups": c.rollout.groups,
             "length_median": float(np.median(every)), "length_p99": float(np.percentile(every, 99)),
             "length_max": int(every.max()), "p99_over_median": float(np.percentile(every, 99) / np.median(every)),
             "tail_time_share": float(np.mean([s["tail_time_share"] for s in timed])),
             "tail_token_share": float(np.mean([s["tail_token_share"] for s in timed])),
             "idle_share": float(np.mean([s["idle_share"] for s in timed]))}
  for mode, rollout in compared.items():
    m = rollout.metrics
    summary.update({f"{mode}/rows": len(rollout.samples), f"{mode}/bucket": max(m.buckets()),
                    f"{mode}/tokens_per_s": m.tokens_per_s, f"{mode}/idle_slot_fraction": m.idle_slot_fraction,
                    f"{mode}/tail_share": m.tail_share})
  summary["refill_over_waves_tokens_per_s"] = compared["refill"].metrics.tokens_per_s / max(
      compared["waves"].metrics.tokens_per_s, 1e-9)
  with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  app.run(main)
