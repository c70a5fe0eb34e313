"""RL objectives side by side: the same config's run under each objective, its held-out reward and cost per step.

  python experiments/objectives.py --out=runs/objectives [--config=configs/smollm2.py] [--arms=default,gspo,...]
      [--config.key=value ...]    # passed to every arm

Arms (`ARMS`): the default (DAPO: token-level clipped ratio, clip-higher), GSPO (sequence-level ratios with
the GSPO paper's clip range), CISPO, and verl's decoupled_geo_rs_seq_tis rollout correction (the old
log-probs recomputed by the trainer, sequence TIS and geometric-mean rejection). Each arm runs
`python -m tlt_jax.main` in <out>/<arm> (a complete run there is kept; an interrupted one resumes), the
later arms from the first arm's drafter (its warm-up is the same for all). The held-out evaluations share
prompts and sampling keys, so each arm's last evaluation is compared with the default's paired over
prompts. Writes objectives.json (each arm's summary, its change, its difference from the default with a 95%
interval, the median seconds per step after the first and their training part) and objectives.png.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from absl import app, flags

from tlt_jax import metrics, report

ARMS = {
    "default": [],
    "gspo": ["--config.rl.loss.importance_level=sequence", "--config.rl.loss.clip_low=0.0003",
             "--config.rl.loss.clip_high=0.0004"],
    "cispo": ["--config.rl.loss.kind=cispo"],
    "decoupled_geo_rs_seq_tis": ["--config.rl.rollout_correction.preset=decoupled_geo_rs_seq_tis"],
}

_OUT = flags.DEFINE_string("out", "runs/objectives", "Output directory.")
_CONFIG = flags.DEFINE_string("config", "configs/smollm2.py", "The config file each arm runs.")
_ARMS = flags.DEFINE_list("arms", list(ARMS), "Arms (of ARMS), the first the baseline.")


def compare(records: dict[str, list[dict]], baseline: str) -> dict[str, dict]:
  """Each arm's last held-out reward minus the baseline's, paired over prompts, and its step times."""
  last = lambda arm: [r for r in records[arm] if "eval/reward" in r][-1]
  out = {}
  for arm, history in records.items():
    steps = [r for r in history if "time/step_s" in r][1:]  # the first compiles
    row = {"step_s": float(np.median([r["time/step_s"] for r in steps])) if steps else None,
           "train_s": float(np.median([r["time/train_s"] for r in steps])) if steps else None}
    a, b = last(baseline)["eval/prompt_rewards"], last(arm)["eval/prompt_rewards"]
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]  # None: nothing scorable
    if arm != baseline and len(a) == len(b) and pairs:
      row.update(vs_baseline=float(np.mean([y - x for x, y in pairs])),
                 vs_baseline_ci95=metrics.ci95([y - x for x, y in pairs]), paired_prompts=len(pairs))
    out[arm] = row
  return out


def main(argv):
  overrides = [a for a in argv[1:] if a.startswith("--config.")]
  if len(overrides) < len(argv) - 1:
    raise app.UsageError(f"unexpected arguments: {[a for a in argv[1:] if a not in overrides]}")
  unknown = [a for a in _ARMS.value if a not in ARMS]
  if unknown:
    raise app.UsageError(f"--arms: unknown {unknown}; known: {', '.join(ARMS)}")
  os.makedirs(_OUT.value, exist_ok=True)
  first = _ARMS.value[0]
  summaries, histories = {}, {}
  for arm in _ARMS.value:
    workdir = os.path.join(_OUT.value, arm)
    if not os.path.exists(os.path.join(workdir, "summary.json")):
      shared = [] if arm == first else [f"--config.drafter.path={os.path.join(_OUT.value, first, 'drafter')}"]
      command = [sys.executable, "-m", "tlt_jax.main", f"--config={_CONFIG.value}", f"--config.workdir={workdir}",
                 "--config.checkpoint.every=1", *shared, *overrides, *ARMS[arm]]
      print("+", " ".join(command), flush=True)
      subprocess.run(command, check=True)
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
      summaries[arm] = json.load(f)
    histories[arm] = metrics.read(os.path.join(workdir, "metrics.jsonl"))
  result = {"config": _CONFIG.value, "arms": {arm: ARMS[arm] for arm in _ARMS.value},
            "compare": compare(histories, first), "runs": summaries}
  report.figure(histories, os.path.join(_OUT.value, "objectives.png"))
  with open(os.path.join(_OUT.value, "objectives.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  for arm, row in result["compare"].items():
    held = summaries[arm].get("held_out", {})
    print(f"{arm:26s} held-out {held.get('first', {}).get('reward', float('nan')):.3f} -> "
          f"{held.get('last', {}).get('reward', float('nan')):.3f}"
          + (f", vs {first} {row['vs_baseline']:+.3f} +- {row['vs_baseline_ci95']:.3f}" if "vs_baseline" in row else "")
          + f"; step {row['step_s']:.0f} s (training {row['train_s']:.0f} s)")


if __name__ == "__main__":
  # --config.key=value overrides are not this script's flags: they stay in argv for main to pass on.
  app.run(main, flags_parser=lambda argv: flags.FLAGS(argv, known_only=True))
