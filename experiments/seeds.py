"""A config's RL run over several seeds: how much of its held-out result is the seed's.

  python experiments/seeds.py --seeds=0,1,2 --out=runs/seeds [--config=configs/tiny.py] [--config.key=value ...]

Runs `python -m tlt_jax.main` once per seed, one after the other, each from nothing in
<out>/seed<N> (a seed changes the SFT warm start, the drafter warm-up, the prompts, the held-out
prompts and the sampling keys; a run already complete there is kept). Writes seeds.json (each run's
closing summary, the range over seeds of the held-out reward first and last and of its change) and
seeds.png (tlt_jax.report.figure, one line per seed), and prints the ranges.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app, flags

from tlt_jax import metrics, report

_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds, one run each.")
_OUT = flags.DEFINE_string("out", "runs/seeds", "Output directory.")
_CONFIG = flags.DEFINE_string("config", None, "A config file for tlt_jax.main (default: its own, the tiny world).")


def _overrides(argv: list[str]) -> list[str]:
  """`--config.key=value` arguments, passed on to each run (absl leaves them to this script's argv)."""
  return [a for a in argv[1:] if a.startswith("--config.")]


def spread(values: list[float]) -> dict:
  return {"min": min(values), "max": max(values), "mean": sum(values) / len(values)}


def main(argv):
  unknown = [a for a in argv[1:] if not a.startswith("--config.")]
  if unknown:
    raise app.UsageError(f"unexpected arguments: {unknown}")
  os.makedirs(_OUT.value, exist_ok=True)
  runs, histories = [], {}
  for seed in map(int, _SEEDS.value):
    workdir = os.path.join(_OUT.value, f"seed{seed}")
    summary_path = os.path.join(workdir, "summary.json")
    if not os.path.exists(summary_path):
      command = [sys.executable, "-m", "tlt_jax.main", *([f"--config={_CONFIG.value}"] if _CONFIG.value else []),
                 *_overrides(argv), f"--config.seed={seed}", f"--config.workdir={workdir}"]
      print("+", " ".join(command), flush=True)
      subprocess.run(command, check=True)
    with open(summary_path, encoding="utf-8") as f:
      runs.append({"seed": seed, **json.load(f)})
    histories[f"seed {seed}"] = metrics.read(os.path.join(workdir, "metrics.jsonl"))
  held = [r["held_out"] for r in runs if "held_out" in r]
  result = {"runs": runs}
  if held:
    result.update(held_out_first=spread([h["first"]["reward"] for h in held]),
                  held_out_last=spread([h["last"]["reward"] for h in held]),
                  held_out_change=spread([h["change"] for h in held if "change" in h] or [0.0]),
                  verdicts=[h.get("verdict") for h in held])
  report.figure(histories, os.path.join(_OUT.value, "seeds.png"))
  with open(os.path.join(_OUT.value, "seeds.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
  # --config.key=value overrides are not this script's flags: they stay in argv for main to pass on.
  app.run(main, flags_parser=lambda argv: flags.FLAGS(argv, known_only=True))
