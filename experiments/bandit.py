"""BEG-MAB vs each fixed strategy vs SD off on long-tail rollouts: `bench --adaptive`'s measurement, plotted.

  python experiments/bandit.py [--config=configs/tiny.py] [--config.workdir=runs/tiny] --out=runs/bandit \
      [--strategies=4_1_5,5_2_8 --rows=32 --repeats=2 --max_new_tokens=128 --sd_max_batch=16]  # the defaults

The policy and drafter: the config's workdir's, else built into <out>/init. The measurement is
`tlt_jax.rollout.benchmark.run_adaptive` (the same as `python -m tlt_jax.bench --adaptive`): one rollout of
--rows problems of the task's own long-tailed difficulty, run with plain decoding, with each
fixed strategy, with SD off alone (drafter kept current) and with the bandit over SD off + all of
them; a warm-up round, then --repeats
interleaved timed rounds, the median round per mode. Writes bandit.json (bench's records),
bandit.csv, bandit.png to --out and prints the summary.
"""

from __future__ import annotations

import csv
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position
from absl import app, flags  # pylint: disable=wrong-import-position
from ml_collections import config_flags  # pylint: disable=wrong-import-position

import starting_point  # pylint: disable=wrong-import-position
from tlt_jax.rl import datasets  # pylint: disable=wrong-import-position
from tlt_jax.rollout import benchmark  # pylint: disable=wrong-import-position
from tlt_jax.rollout.speculative import Strategy  # pylint: disable=wrong-import-position

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(os.path.dirname(__file__), "..", "configs",
                                                                 "tiny.py"), "Config naming the workdir.")
_OUT = flags.DEFINE_string("out", "runs/bandit", "Output directory.")
# The defaults: a few minutes on a 2-core CPU (`python -m tlt_jax.bench --adaptive`'s are 4x the work).
_STRATEGIES = flags.DEFINE_list("strategies", ["4_1_5", "5_2_8"], "depth_topk_verify strategies: the bandit's arms.")
_ROWS = flags.DEFINE_integer("rows", 32, "Rows (task problems) of the rollout.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed rounds after the warm-up round.", lower_bound=1)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens per row at most.")
_SD_MAX_BATCH = flags.DEFINE_integer("sd_max_batch", 16, "Speculate at most this many active rows.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature (0 = greedy).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the problems and of sampling.")

COLUMNS = ("mode", "tokens_per_s", "speedup", "accept_len", "sd_share", "compilations", "vs_best_fixed",
           "vs_worst_fixed")


def plot(records, path):
  fig, ax = plt.subplots(figsize=(6, 3.5))
  modes = [r["mode"] for r in records]
  bars = ax.bar(modes, [r["tokens_per_s"] for r in records],
                color=["gray", "silver"] + ["tab:blue"] * (len(records) - 3) + ["tab:orange"])
  for bar, r in zip(bars, records):
    label = f"{r['speedup']:.2f}x" + (f"\nL={r['accept_len']:.2f}" if r["accept_len"] else "")
    ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
  ax.set(ylabel="tokens/s (whole rollout)", title="BEG-MAB vs its arms alone vs plain")
  ax.margins(y=0.2)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main(argv):
  del argv
  out = _OUT.value
  os.makedirs(out, exist_ok=True)
  _, _, model, tok, drafter = starting_point.load(_CONFIG.value, out)
  prompts = [ex.prompt_ids
             for ex in datasets.from_tasks(_CONFIG.value.task.family, tok, size=_ROWS.value, seed=_SEED.value)]
  stop = sorted(set(model.config.stop_token_ids) | {tok.eos_token_id})
  records = benchmark.run_adaptive(model, drafter, prompts, [Strategy.parse(s) for s in _STRATEGIES.value],
                                   _TEMPERATURE.value, _MAX_NEW.value, _SEED.value, stop, _SD_MAX_BATCH.value,
                                   _REPEATS.value)
  with open(os.path.join(out, "bandit.json"), "w", encoding="utf-8") as f:
    json.dump(records, f, indent=2)
  with open(os.path.join(out, "bandit.csv"), "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(records)
  plot(records, os.path.join(out, "bandit.png"))
  for r in records:
    print(json.dumps({k: r[k] for k in COLUMNS if k in r}))


if __name__ == "__main__":
  app.run(main)
