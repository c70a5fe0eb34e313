"""What a run did, for the person who started it: the closing summary and a figure of the run.

`summary(records, workdir)` reads a run's metrics records (metrics.jsonl, resumed parts included)
and leads with the held-out evaluation (first and last, each with its 95% interval, and whether
the change is larger than their noise), then what the steps could learn from (failed reward calls,
steps without an update), then the rollout's figures (tokens/s, the tail's share of
decode time, acceptance length, drafter version), then where the outputs are. `text` renders it for
the terminal; `figure` draws reward (held-out, with intervals, and training), response length,
rollout time and acceptance per step (matplotlib, an optional dependency: without it, one line saying so and no figure).
"""

from __future__ import annotations

import math
import os
from typing import Sequence

from absl import logging

from tlt_jax import files
from tlt_jax import memory
from tlt_jax import metrics

FIGURE = "run.png"


def _mean(values: Sequence[float]) -> float | None:
  values = [v for v in values if v is not None and math.isfinite(v)]
  return sum(values) / len(values) if values else None


def held_out(records: list[dict], prefix: str = "eval/") -> dict | None:
  """The first and last evaluations of a set (records `<prefix>reward` etc.: the held-out set's
  `eval/`, a named set's `eval/<name>/`) and the change between them, with its 95% interval: paired
  over prompts (the evaluations share prompts and sampling keys, so a prompt's difference is what
  the policy changed), or, for records without per-prompt rewards, from the two intervals as if
  independent (wider)."""
  evals = [r for r in records if f"{prefix}reward" in r]
  if not evals:
    return None
  first, last = evals[0], evals[-1]
  get = lambda r, key: r.get(f"{prefix}{key}")
  passes = lambda r: {k[len(prefix):]: v for k, v in r.items() if k.startswith(f"{prefix}pass@")}
  point = lambda r: {"step": r["step"], "reward": get(r, "reward"), "ci95": get(r, "reward_ci95"),
                     "answered": get(r, "answered"), "accuracy": get(r, "accuracy"), **passes(r)}
  out = {"first": point(first), "last": point(last), "evaluations": len(evals)}
  if len(evals) < 2:
    return out
  out["change"] = get(last, "reward") - get(first, "reward")
  a, b = get(first, "prompt_rewards"), get(last, "prompt_rewards")
  if a and b and len(a) == len(b):  # None: a prompt with no scorable response, out of the pairs
    pairs = [y - x for x, y in zip(a, b) if x is not None and y is not None]
    out["change_ci95"] = metrics.ci95(pairs)
    out["change_interval"] = f"paired over {len(pairs)} prompts"
  elif get(first, "reward_ci95") is not None and get(last, "reward_ci95") is not None:
    out["change_ci95"] = math.hypot(get(first, "reward_ci95"), get(last, "reward_ci95"))
    out["change_interval"] = "the two evaluations' intervals combined"
  if "change_ci95" in out:
    noise = out["change_ci95"]
    out["verdict"] = "up" if out["change"] > noise else "down" if out["change"] < -noise else "within noise"
  return out


def eval_sets(records: list[dict]) -> dict:
  """`held_out` of each named evaluation set (`eval.sets`) the records hold."""
  names = sorted({k.split("/")[1] for r in records for k in r if k.startswith("eval/") and k.count("/") == 2})
  return {name: held_out(records, f"eval/{name}/") for name in names}


def rollout(records: list[dict]) -> dict:
  """Rollout figures over the RL steps after the first (it compiles): means per step, the
  acceptance length over the steps that speculated, the last drafter version."""
  steps = [r for r in records if "reward/mean" in r]
  later = steps[1:] or steps
  pick = lambda key, rs=later: _mean([r.get(key) for r in rs])
  out = {"tokens_per_s": pick("rollout/tokens_per_s"), "rollout_s": pick("time/rollout_s"),
         "step_s": pick("time/step_s"), "tail_share": pick("rollout/tail_share"),
         "sd_share": pick("rollout/sd_share"),
         "accept_len": _mean([r.get("rollout/accept_len") for r in later if (r.get("rollout/sd_share") or 0) > 0]),
         "compilations_after_first_step": sum(r.get("rollout/compilations", 0) for r in steps[1:])}
  gap = {k: _mean([r.get(f"mismatch/{k}") for r in steps]) for k in ("logp_abs_diff", "k3_kl")}
  if gap["logp_abs_diff"] is not None:
    out["mismatch"] = gap
  versions = [r["drafter/version"] for r in steps if "drafter/version" in r]
  if versions:
    out["drafter_version"] = int(versions[-1])
  return {k: v for k, v in out.items() if v is not None}


def training_reward(records: list[dict]) -> dict | None:
  """Mean training reward over the first and the last few steps (each step's prompts differ, so a
  single step's mean swings with their difficulty)."""
  steps = [r for r in records if "reward/mean" in r]
  if not steps:
    return None
  window = max(1, min(5, len(steps) // 2))
  mean = lambda part: sum(r["reward/mean"] for r in part) / len(part)
  return {"first_steps": mean(steps[:window]), "last_steps": mean(steps[-window:]), "window": window}


def training(records: list[dict]) -> dict | None:
  """What the steps could learn from: reward calls that failed or timed out (each scored 0), in the steps and
  in the evaluations, and the steps without a policy update (no group with a reward signal, or every update
  skipped)."""
  steps = [r for r in records if "reward/mean" in r]
  if not steps:
    return None
  return {"reward_failures": int(sum(r.get("reward/failures", 0) + r.get("reward/timeouts", 0) for r in steps)),
          "eval_reward_failures": int(sum(v for r in records for k, v in r.items() if k.startswith("eval/")
                                          and k.endswith("reward_failures"))),
          "steps_without_update": sum(r.get("train/updates", 0) == 0 for r in steps), "steps": len(steps)}


def summary(records: list[dict], workdir: str, *, figure: str | None = None, wall_s: float | None = None) -> dict:
  steps = [r["step"] for r in records if "reward/mean" in r]
  out = {"steps": max(steps, default=0), "wall_s": wall_s, "held_out": held_out(records),
         "eval_sets": eval_sets(records) or None, "rollout": rollout(records),
         "training_reward": training_reward(records), "training": training(records), "memory": peak_memory(records)}
  paths = {"metrics": os.path.join(workdir, "metrics.jsonl"), "completions": os.path.join(workdir, "completions.jsonl"),
           "tensorboard": os.path.join(workdir, "tensorboard"),
           "figure": figure, "export": os.path.join(workdir, "export"),
           "checkpoints": os.path.join(workdir, "checkpoints")}
  out["outputs"] = {k: v for k, v in paths.items() if v and os.path.exists(v)}
  return {k: v for k, v in out.items() if v is not None}


def peak_memory(records: list[dict]) -> dict | None:
  """The run's peak memory and the phase that set it: the host process's resident set and, where the backend
  keeps it, the devices' bytes in use (tlt_jax.memory)."""
  out = {}
  for where, prefix in (("host", "memory/"), ("device", "memory/device/")):
    found = memory.peak_phase(records, prefix)
    if found:
      out[where] = {"phase": found[0], "gb": found[1]}
  return out or None


def _pm(value: float, ci: float | None) -> str:
  return f"{value:.3f}" + (f" +- {ci:.3f}" if ci is not None else "")


def text(s: dict) -> str:
  """The summary as a few lines for the terminal."""
  minutes = f" ({s['wall_s'] / 60:.1f} min in this process)" if s.get("wall_s") else ""
  lines = [f"RL: {s['steps']} step{'' if s['steps'] == 1 else 's'}{minutes}"]
  h = s.get("held_out")
  if h:
    first, last = h["first"], h["last"]
    lines.append(f"  held-out reward (95% interval): {_pm(first['reward'], first['ci95'])} at step {first['step']} "
                 f"-> {_pm(last['reward'], last['ci95'])} at step {last['step']}")
    if "verdict" in h:
      lines.append(f"    change {h['change']:+.3f} +- {h['change_ci95']:.3f} ({h['change_interval']}): "
                   f"{h['verdict']}")
    if first.get("answered") is not None and last.get("answered") is not None:
      lines.append(f"  held-out responses with an answer line: {first['answered']:.0%} -> {last['answered']:.0%}")
  else:
    lines.append("  no held-out evaluation (config.eval.every=0)")
  for name, e in (s.get("eval_sets") or {}).items():
    first, last = e["first"], e["last"]
    passes = ", ".join(f"{k} {last[k]:.3f}" for k in last if k.startswith("pass@"))
    lines.append(f"  {name}: reward {_pm(first['reward'], first['ci95'])} at step {first['step']} -> "
                 f"{_pm(last['reward'], last['ci95'])} at step {last['step']}; {passes}")
  t = s.get("training_reward")
  if t:
    lines.append(f"  training reward, first / last {t['window']} steps: {t['first_steps']:.3f} / "
                 f"{t['last_steps']:.3f} (each step's prompts differ: noisy)")
  t = s.get("training")
  if t:
    lines.append(f"  reward calls failed: {t['reward_failures']} in the steps, {t['eval_reward_failures']} in the "
                 f"evaluations; steps without a policy update: {t['steps_without_update']} of {t['steps']}")
    if t["steps_without_update"] == t["steps"]:
      lines.append("  THE POLICY WAS NEVER UPDATED: no step had a group whose rewards differed (or every update was "
                   "skipped); it is the policy the run started from")
  r = s.get("rollout", {})
  parts = []
  if "tokens_per_s" in r:
    parts.append(f"{r['tokens_per_s']:.0f} tokens/s")
  if "tail_share" in r:
    parts.append(f"tail {r['tail_share']:.0%} of decode time")
  if "accept_len" in r:
    parts.append(f"acceptance {r['accept_len']:.2f} tokens per verify")
  if "drafter_version" in r:
    parts.append(f"drafter v{r['drafter_version']}")
  if parts:
    lines.append("rollout (steps after the first): " + ", ".join(parts))
  if "mismatch" in r:
    m = r["mismatch"]
    lines.append(f"training-inference mismatch (every step): mean |rollout - trainer log p| {m['logp_abs_diff']:.2e}, "
                 f"KL {m['k3_kl']:.2e}")
  if s.get("memory"):
    lines.append("peak memory: " + ", ".join(f"{where} {m['gb']:.2f} GB (in {m['phase']})"
                                              for where, m in s["memory"].items()))
  lines.append("outputs:")
  for name, path in s.get("outputs", {}).items():
    lines.append(f"  {name + ':':13s}{path}")
  return "\n".join(lines)


def figure(histories: dict[str, list[dict]], path: str) -> str | None:
  """A PNG of reward (held-out, with its intervals, and training), response length, rollout time and
  acceptance length per step, one line per run in `histories` (name -> metrics records; e.g. TLT and plain
  rollouts side by side). Returns its path, or None (one logged line) without matplotlib."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    logging.warning("no figure of the run: matplotlib is not installed (pip install matplotlib)")
    return None
  fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
  for name, records in histories.items():
    evals = [r for r in records if "eval/reward" in r]
    steps = [r for r in records if "reward/mean" in r]
    x = [r["step"] for r in steps]
    line = axes[0].plot(x, [r["reward/mean"] for r in steps], lw=0.8, alpha=0.5, label=f"{name} training")
    if evals:
      axes[0].errorbar([r["step"] for r in evals], [r["eval/reward"] for r in evals],
                       yerr=[r.get("eval/reward_ci95", 0.0) for r in evals], marker="o", capsize=3,
                       color=line[0].get_color(), label=f"{name} held-out (95% interval)")
    line = axes[1].plot(x, [r.get("response_length/median") for r in steps], marker=".", label=f"{name} median")
    axes[1].plot(x, [r.get("response_length/p90") for r in steps], ls="--", color=line[0].get_color(),
                 label=f"{name} p90")
    axes[2].plot(x, [r.get("time/rollout_s") for r in steps], marker=".", label=name)
    sd = [r for r in steps if (r.get("rollout/sd_share") or 0) > 0]  # NaN (not recorded) is not > 0
    if sd:
      axes[3].plot([r["step"] for r in sd], [r.get("rollout/accept_len") for r in sd], marker=".", label=name)
  titles = ("reward", "response length (tokens)", "rollout time (s; a first step compiles)",
            "acceptance length (tokens per verify)")
  for ax, title in zip(axes, titles):
    ax.set(title=title, xlabel="RL step")
    if ax.has_data():
      ax.legend(fontsize=7)
  axes[2].set_yscale("log")
  fig.tight_layout()
  with files.atomic_file(path) as tmp:
    fig.savefig(tmp, dpi=100, format="png")
  plt.close(fig)
  return path
