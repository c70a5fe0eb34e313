"""SD speedup over batch size x verify tokens, and a draft top-k sweep (the paper's Tables 4 and 1).

  python experiments/sd_grid.py [--config=configs/tiny.py] [--config.workdir=runs/tiny] --out=runs/sd_grid \
      [--grid_batch_sizes=1,4,16 --verify_tokens=4,8,16 --topk_sweep=1,2,4 --max_new_tokens=128]

  # a real model: its HF directory, a drafter distilled on it, chat prompts
  python experiments/sd_grid.py --config.policy.path=models/smollm2 --config.drafter.path=runs/smollm2/drafter \
      --prompts=runs/smollm2/eval.jsonl --out=runs/sd_grid_smollm2

The policy and drafter: `policy.path` / `drafter.path` when set, else the config's workdir's
(`<workdir>/{policy,drafter}`), else built into
<out>/init (SFT warm start and drafter warm-up, ~5 minutes on a 2-core CPU). Both tables come from
`tlt_jax.rollout.benchmark.run_grid` (SD vs plain decoding on the same long prompts, compaction off so every step
runs at the cell's batch size, the median of 3 timed rollouts after a warm-up one) on `--prompts`
(chat-templated) or the config task's long problems. Writes
grid.csv, topk.csv, sd_grid.png and summary.json to --out and prints the summary.
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
from tlt_jax.prompts import read_prompts  # pylint: disable=wrong-import-position
from tlt_jax.rl import datasets, tasks  # pylint: disable=wrong-import-position
from tlt_jax.rollout import benchmark  # pylint: disable=wrong-import-position
from tlt_jax.rollout.speculative import Strategy  # pylint: disable=wrong-import-position

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(os.path.dirname(__file__), "..", "configs",
                                                                 "tiny.py"), "Config naming the workdir.")
_OUT = flags.DEFINE_string("out", "runs/sd_grid", "Output directory.")
_BATCH_SIZES = flags.DEFINE_list("grid_batch_sizes", ["1", "4", "16"], "Batch sizes of the grid.")
_DEPTH = flags.DEFINE_integer("depth", 5, "Draft depth of every strategy.")
_TOP_K = flags.DEFINE_integer("top_k", 4, "Draft top-k of the grid's strategies.")
_VERIFY = flags.DEFINE_list("verify_tokens", ["4", "8", "16"], "Verify-token counts of the grid.")
_SWEEP = flags.DEFINE_list("topk_sweep", ["1", "2", "4"], "Draft top-k values of the sweep.")
_SWEEP_VERIFY = flags.DEFINE_integer("topk_verify_tokens", 8, "Verify tokens of the sweep (fewer where the tree "
                                     "has fewer candidates: a chain verifies depth + 1).")
_SWEEP_BATCH = flags.DEFINE_integer("topk_batch_size", 1, "Batch size of the sweep.")
_PROMPTS = flags.DEFINE_string("prompts", None, "Prompts JSONL file (default: the config task's long problems).")
_MIN_TERMS = flags.DEFINE_integer("min_terms", 16, "Fewest terms per task problem (long problems, long responses).")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature (0 = greedy).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens per row at most.")


def sweep_strategy(top_k: int) -> Strategy:
  candidates = top_k + (_DEPTH.value - 1) * top_k**2
  return Strategy(_DEPTH.value, top_k, min(_SWEEP_VERIFY.value, 1 + candidates))


def write_csv(records, path):
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=list(records[0]))
    writer.writeheader()
    writer.writerows(records)


def plot(grid, sweep, path):
  batches = sorted({r["batch_size"] for r in grid})
  names = list(dict.fromkeys(r["strategy"] for r in grid))
  speedup = np.array([[next(r["speedup"] for r in grid if r["batch_size"] == b and r["strategy"] == s)
                       for s in names] for b in batches])
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  image = axes[0].imshow(speedup, cmap="RdYlGn", vmin=0.0, vmax=2.0)
  for (i, j), v in np.ndenumerate(speedup):
    axes[0].text(j, i, f"{v:.2f}x", ha="center", va="center")
  axes[0].set(xticks=range(len(names)), xticklabels=names, yticks=range(len(batches)), yticklabels=batches,
              xlabel="strategy (depth_topk_verify)", ylabel="batch size", title="SD speedup over plain decoding")
  fig.colorbar(image, ax=axes[0])
  ks = [r["top_k"] for r in sweep]
  axes[1].plot(ks, [r["accept_len"] for r in sweep], "o-", label="acceptance length")
  axes[1].plot(ks, [r["speedup"] for r in sweep], "s--", label="speedup")
  axes[1].set(xticks=ks, xlabel="draft top-k",
              title=f"top-k sweep (batch {_SWEEP_BATCH.value})")
  axes[1].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main(argv):
  del argv
  out = _OUT.value
  os.makedirs(out, exist_ok=True)
  policy_dir, drafter_dir, model, tok, drafter = starting_point.load(_CONFIG.value, out)
  batch_sizes = [int(b) for b in _BATCH_SIZES.value]
  top = max(batch_sizes + [_SWEEP_BATCH.value])
  if _PROMPTS.value:
    prompts = read_prompts(_PROMPTS.value, tok, chat=bool(tok.chat_template),
                           max_len=model.config.max_position_embeddings,
                           vocab_size=model.config.vocab_size)[:top]
  else:
    difficulty = tasks.Difficulty(min_terms=_MIN_TERMS.value, max_terms=max(_MIN_TERMS.value, 24))
    prompts = [ex.prompt_ids for ex in datasets.from_tasks(_CONFIG.value.task.family, tok, size=top, seed=0,
                                                           difficulty=difficulty)]
  stop = sorted(set(model.config.stop_token_ids) | {tok.eos_token_id})
  measure = lambda sizes, strategies: benchmark.run_grid(model, drafter, prompts, sizes, strategies,
                                                         _TEMPERATURE.value, _MAX_NEW.value, 0, stop)
  grid = measure(batch_sizes, [Strategy(_DEPTH.value, _TOP_K.value, int(v)) for v in _VERIFY.value])
  for r in grid:
    r["verify_tokens"] = Strategy.parse(r["strategy"]).verify_tokens
  sweep = measure([_SWEEP_BATCH.value], [sweep_strategy(int(k)) for k in _SWEEP.value])
  for r in sweep:
    r["top_k"] = Strategy.parse(r["strategy"]).top_k
  write_csv(grid, os.path.join(out, "grid.csv"))
  write_csv(sweep, os.path.join(out, "topk.csv"))
  plot(grid, sweep, os.path.join(out, "sd_grid.png"))
  best = max(grid, key=lambda r: r["speedup"])
  summary = {"policy": policy_dir, "drafter": drafter_dir, "best_cell": best,
             "speedup_by_batch": {b: max(r["speedup"] for r in grid if r["batch_size"] == b) for b in batch_sizes},
             "topk_accept_len": {r["top_k"]: r["accept_len"] for r in sweep},
             "topk_speedup": {r["top_k"]: r["speedup"] for r in sweep}}
  with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  app.run(main)
