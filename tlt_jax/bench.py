"""Speculative-decoding speed grid: batch size x strategy, SD vs plain decoding on the same prompts.

  python -m tlt_jax.bench --model=DIR --drafter=DIR --output=FILE.json \\
      [--batch_sizes=1,2,4,8,16,32 --strategies=4_2_8,6_4_16 --temperatures=0,1 --max_new_tokens=128]

  python -m tlt_jax.bench --adaptive --model=DIR --drafter=DIR --output=FILE.json [--rows=64 ...]

  python -m tlt_jax.bench --phases --model=DIR --drafter=DIR --output=FILE.json [--batch_sizes=1,4 ...]

  python -m tlt_jax.bench --refill --model=DIR --output=FILE.json [--rows=32 --num_samples=1 --bucket=8 ...]

  python -m tlt_jax.bench --paged --model=DIR --output=FILE.json [--rows=8 --num_samples=8 --bucket=16 \
      --paged_bucket=64 --page_size=32 ...]

The measurements are `tlt_jax.rollout.benchmark`'s; this module reads flags and files.

Prompts: `--prompts=FILE.jsonl` (text prompts chat-templated when the tokenizer has a template, as
train_drafter reads them), else procedural `--task` problems.

Grid mode: prompts are procedural problems with at least `--min_terms` terms, so responses are
long (the tail's regime); rows stop at EOS or `--max_new_tokens`. Compaction is off, so every step runs at
the cell's batch size; a cell of batch size b rolls out b rows, or `--rows` (the same batch size over more
prompts, b at once, refilled). Each cell times one rollout after a warm-up rollout (compilation excluded). Writes
JSON: `cli.provenance()` (command, machine, commit, date) and "rows", a list of
{temperature, batch_size, rows, strategy, verify_tokens, tokens_per_s, baseline_tokens_per_s, speedup,
accept_len} (one grid per `--temperatures`, else `--temperature`), the same table as CSV next to it,
and, with matplotlib, a PNG beside it: tokens accepted per verify against verify tokens, one line per
temperature (the paper's Table 4 shape), at the smallest batch size. The counterpart of the
reference's bench_sd. With `--num_samples` N, a
cell of batch size b rolls out ceil(b / N) prompts x N samples, b rows at once at most (siblings
refilled): suffix strategies (`s<depth>_<matches>_<verify>`, no drafter needed) draft from
siblings. `--history_len` also times each suffix strategy with each prompt's responses from an
earlier rollout (another seed) in its bank (`<strategy>+history`).

Phases mode (`--phases`): per batch size and strategy, one speculative iteration split into its
phases (draft, verify with acceptance and commit, drafter feed), each timed alone, beside the
fused iteration, a plain step and the engine's segment executable per iteration
(`tlt_jax.rollout.profile`): where the time goes when speculation does not pay. A drafter with a
reduced-vocabulary head is also timed with the full head on the same layers (`draft_vocab` column):
draft cost and acceptance length side by side.

Adaptive mode (`--adaptive`): one long-tailed rollout of `--rows` problems x `--num_samples` (compaction on,
speculation once at most `--sd_max_batch` rows are active), run with plain decoding, with each
fixed strategy, with SD off (the same engine, drafter kept current), and with the BEG-MAB
bandit over all of these arms. A warm-up round runs
every mode once (compilation; the bandit's first plays), then `--repeats` timed rounds run every
mode once each, interleaved so that load on the machine hits all modes alike. Records
{mode, tokens_per_s, tokens_per_s_rounds, speedup, accept_len, sd_share, compilations} (whole-rollout
tokens/s, the median round's, and every timed round's; what the timed rollouts compiled, none when the
engines hold every executable) and, for the bandit, its ratio to the best and the worst of its arms
played alone (SD off and each strategy; `speedup` is against plain decoding without a drafter), its
share of the time spent learning (exploring plays, and an arm's first play at a bucket: one-time
setup) and its rate outside those against the best arm (`settled_vs_best_fixed`), its plays during
warm-up and the timed rounds, the median round's rollout summary, and its plays and windowed rewards
per bucket (it keeps learning across all rounds).

Refill mode (`--refill`): one long-tailed rollout of `--rows` problems x `--num_samples` through a
largest batch bucket of `--bucket`, plain decoding (no drafter), run in waves (each waits for
its longest row), with refill (finished rows' slots take waiting rows, in order) and with refill
taking the longest expected rows first (`longest_first`: each prompt's mean response length in the
warm-up round, known exactly, so the best case of that scheduling policy), interleaved over
`--repeats` timed rounds after a warm-up one. Records {mode, tokens_per_s, speedup (over waves),
wall_s, refills, idle_slot_fraction, tail_share, p99_over_median, same_samples} (the median
round's) and prints the refill / waves tokens/s ratio.

Paged mode (`--paged`): one rollout of `--rows` prompts x `--num_samples` (plain decoding, refill)
with the contiguous KV cache of `--bucket` rows and with a paged cache of the same bytes
(`--page_size`-slot pages, up to `--paged_bucket` rows in flight; a prompt's full pages held once
for its samples), interleaved over `--repeats` timed rounds after a warm-up one. Records {mode,
rows, cache_slots, tokens_per_s, speedup (over contiguous), wall_s, prefill_s, prefill_ms_per_row,
peak_rows, preemptions, resumed_tokens, refills, mean_response_len, same_samples} (the median
round's) and prints the paged / contiguous tokens/s ratio. `same_samples` needs the same batch sizes
in both (then the tokens are identical, as tests/rollout/test_engine.py checks): a larger batch
changes the order of float sums in XLA:CPU's matmuls, so sampled tokens may differ (their
distribution does not).
"""

from __future__ import annotations

import csv
import json
import math
import os

from absl import flags
from flax import nnx

from tlt_jax import cli, files
from tlt_jax.drafter import checkpoint
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import hf
from tlt_jax.prompts import read_prompts
from tlt_jax.rl import datasets, tasks
from tlt_jax.rollout import benchmark
from tlt_jax.rollout.speculative import Strategy

# Required only when run as the CLI: experiments import this module for its measuring functions and flags.
_MODEL = flags.DEFINE_string("model", None, "Hugging Face model directory of the target.")
_SCAN_LAYERS = cli.define_scan_layers()
_DRAFTER = flags.DEFINE_string("drafter", None, "Drafter directory (train_drafter output) or 'random'.")
_OUTPUT = flags.DEFINE_string("output", None, "Output JSON file (a CSV is written beside it).")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8", "16", "32"], "Batch sizes.")
_STRATEGIES = flags.DEFINE_list("strategies", ["4_1_5", "4_2_8", "6_4_16"], "depth_topk_verify strategies.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature (0 = greedy).")
_TEMPERATURES = flags.DEFINE_list("temperatures", [], "Grid mode: one grid per temperature (default: --temperature).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Tokens per row at most.")
cli.check_sampling_flags(temperature=_TEMPERATURE, max_new_tokens=_MAX_NEW)
_TASK = flags.DEFINE_string("task", "basic_arithmetic", "Procedural task for prompts (needs a tokenizer in --model).")
_PROMPTS = flags.DEFINE_string("prompts", None, "Prompts JSONL file (instead of --task problems).")
_PHASES = flags.DEFINE_bool("phases", False,
                            "Time each phase of one speculative iteration per batch size and strategy.")
_MIN_TERMS = flags.DEFINE_integer("min_terms", 16, "Fewest terms per problem (longer problems, longer responses).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of prompts and sampling.")
_ADAPTIVE = flags.DEFINE_bool("adaptive", False, "Bandit vs every fixed strategy vs SD off on a long-tail rollout.")
_ROWS = flags.DEFINE_integer("rows", 64, "Rows of the adaptive mode's rollout; in grid mode, when given, the rows "
                             "of each cell, at most its batch size at once (default: the batch size).", lower_bound=1)
_SD_MAX_BATCH = flags.DEFINE_integer("sd_max_batch", 32, "Adaptive mode: speculate at most this many active rows.",
                                     lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Adaptive and refill modes: timed rounds after the warm-up round.",
                                lower_bound=1)
_REFILL = flags.DEFINE_bool("refill", False, "Refill vs waves on a rollout of more rows than the largest bucket.")
_BUCKET = flags.DEFINE_integer("bucket", 8, "Refill mode: the largest batch bucket (a power of two).", lower_bound=1)
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Samples per prompt (a GRPO group; grid, adaptive, refill).",
                                     lower_bound=1)
_PAGED = flags.DEFINE_bool("paged", False, "A paged KV cache vs the contiguous one in the same bytes.")
_PAGED_BUCKET = flags.DEFINE_integer("paged_bucket", 64, "Paged mode: the paged cache's largest batch bucket.",
                                     lower_bound=1)
_PAGE_SIZE = flags.DEFINE_integer("page_size", 32, "Paged mode: slots per page (also the attention block).",
                                  lower_bound=1)
_HISTORY_LEN = flags.DEFINE_integer("history_len", 0, "Grid mode: also time suffix strategies with this many tokens "
                                    "of an earlier rollout's responses per prompt in the bank (0: off).", lower_bound=0)


def _numbers(flag: flags.FlagHolder, kind: type, least: float, what: str) -> list:
  """A list flag's values as finite numbers of `kind`, each at least `least`."""
  try:
    values = [kind(v) for v in flag.value]
  except ValueError:
    values = []
  if not values or not all(math.isfinite(v) and v >= least for v in values):
    raise cli.InputError(f"--{flag.name}={','.join(flag.value)}: expected {what}")
  return values


def _batch_sizes() -> list[int]:
  return _numbers(_BATCH_SIZES, int, 1, "positive integers")


def _temperatures() -> list[float]:
  return _numbers(_TEMPERATURES, float, 0, "numbers >= 0") if _TEMPERATURES.value else [_TEMPERATURE.value]


def _strategies() -> list[Strategy]:
  try:
    return [Strategy.parse(s) for s in _STRATEGIES.value]
  except ValueError as e:
    raise cli.InputError(f"--strategies={','.join(_STRATEGIES.value)}: {e}") from None


def _prompts(tokenizer, cfg, needed: int) -> list[list[int]]:
  """`needed` prompts: the first of --prompts, else --task problems (long ones outside --adaptive)."""
  if _PROMPTS.value:
    with cli.named("prompts", _PROMPTS.value):
      prompts = read_prompts(_PROMPTS.value, tokenizer, chat=tokenizer is not None and bool(tokenizer.chat_template),
                             max_len=cfg.max_position_embeddings, vocab_size=cfg.vocab_size)
    if len(prompts) < needed:
      raise cli.InputError(f"--prompts={_PROMPTS.value} has {len(prompts)} prompts; this run needs {needed}")
    return prompts[:needed]
  if tokenizer is None:
    raise cli.InputError(f"--model={_MODEL.value} has no tokenizer to build --task={_TASK.value} prompts with")
  with cli.named("model", _MODEL.value):
    if _ADAPTIVE.value or _REFILL.value or _PAGED.value:  # the task's own long-tailed difficulty
      return [ex.prompt_ids for ex in datasets.from_tasks(_TASK.value, tokenizer, size=needed, seed=_SEED.value)]
    difficulty = tasks.Difficulty(min_terms=_MIN_TERMS.value, max_terms=max(_MIN_TERMS.value, 24))
    return [ex.prompt_ids for ex in datasets.from_tasks(_TASK.value, tokenizer, size=needed, seed=_SEED.value,
                                                        difficulty=difficulty)]


def main(argv):
  del argv
  strategies, batch_sizes = _strategies(), _batch_sizes()
  if not strategies:
    raise cli.InputError("--strategies: name at least one depth_topk_verify strategy")
  if _PHASES.value and any(s.suffix for s in strategies):
    raise cli.InputError(f"--strategies={','.join(_STRATEGIES.value)}: --phases times the EAGLE drafter's phases; "
                         "suffix strategies have none")
  csv_path = os.path.splitext(_OUTPUT.value)[0] + ".csv"
  inputs = {"model": _MODEL.value, "drafter": _DRAFTER.value}
  if os.path.abspath(csv_path) == os.path.abspath(_OUTPUT.value):
    raise cli.InputError(f"--output={_OUTPUT.value}: the table is also written beside it as {csv_path}; "
                         "give the output a .json name")
  for path in (_OUTPUT.value, csv_path):
    cli.check_output("output", path, inputs)
  if not _PROMPTS.value and _TASK.value not in tasks.FAMILIES:
    raise cli.InputError(f"--task={_TASK.value}: unknown task family; known: {sorted(tasks.FAMILIES)}")
  with cli.named("model", _MODEL.value):  # the cheap parts first: config, tokenizer, drafter
    cfg, _ = hf.read_config(_MODEL.value)
    tokenizer = hf.load_tokenizer(_MODEL.value)
  rollout_modes = _ADAPTIVE.value or _REFILL.value or _PAGED.value
  grid_rows = _ROWS.value if flags.FLAGS["rows"].present and not rollout_modes else 0
  prompts = _prompts(tokenizer, cfg, _ROWS.value if rollout_modes else max(*batch_sizes, grid_rows))
  for flag in (_BUCKET, _PAGED_BUCKET):
    if flag.value & (flag.value - 1):
      raise cli.InputError(f"--{flag.name}={flag.value}: must be a power of two")
  if _REFILL.value or _PAGED.value:
    drafter = None  # plain decoding: refill and waves differ before the tail, where speculation does not run
  elif not _DRAFTER.value and all(s.suffix for s in strategies) and not _PHASES.value:
    drafter = None  # suffix drafts need no drafter model
  elif not _DRAFTER.value:
    raise cli.InputError("--drafter: a drafter directory or 'random' is needed outside --refill and --paged")
  elif _DRAFTER.value == "random":
    drafter = Drafter(cfg, rngs=nnx.Rngs(_SEED.value))
  else:
    with cli.named("drafter", _DRAFTER.value):
      drafter = checkpoint.load_drafter(_DRAFTER.value, cfg)
  with cli.named("model", _MODEL.value):
    model = hf.from_pretrained(_MODEL.value, scan_layers=cli.scan_layers(_SCAN_LAYERS))
  stop = set(model.config.stop_token_ids) | ({tokenizer.eos_token_id} if tokenizer is not None else set())
  temperature, max_new, seed = _TEMPERATURE.value, _MAX_NEW.value, _SEED.value
  if _REFILL.value:
    records = benchmark.run_refill(model, prompts, _NUM_SAMPLES.value, _BUCKET.value, temperature, max_new, seed,
                                   sorted(stop), _REPEATS.value)
  elif _PAGED.value:
    records = benchmark.run_paged(model, prompts, _NUM_SAMPLES.value, _BUCKET.value, _PAGED_BUCKET.value,
                                  _PAGE_SIZE.value, temperature, max_new, seed, sorted(stop), _REPEATS.value)
  elif _PHASES.value:
    records = benchmark.run_phases(model, drafter, prompts, batch_sizes, strategies, temperature, max_new, seed)
  elif _ADAPTIVE.value:
    records = benchmark.run_adaptive(model, drafter, prompts, strategies, temperature, max_new, seed, sorted(stop),
                                     _SD_MAX_BATCH.value, _REPEATS.value, _NUM_SAMPLES.value)
  else:
    records = [{"temperature": t, **r} for t in _temperatures() for r in benchmark.run_grid(
        model, drafter, prompts, batch_sizes, strategies, t, max_new, seed, sorted(stop), _NUM_SAMPLES.value,
        _HISTORY_LEN.value, grid_rows)]
    benchmark.plot_acceptance(records, os.path.splitext(_OUTPUT.value)[0] + ".png")
  with files.atomic_file(_OUTPUT.value) as tmp_json, files.atomic_file(csv_path) as tmp_csv:
    with open(tmp_json, "w", encoding="utf-8") as f:
      json.dump({**cli.provenance(), "rows": records}, f, indent=2)
    with open(tmp_csv, "w", encoding="utf-8", newline="") as f:
      writer = csv.DictWriter(f, fieldnames=list(records[0]), extrasaction="ignore")
      writer.writeheader()
      writer.writerows(records)
  for r in records:
    print(json.dumps(r))
  if _REFILL.value:
    print(f"refill / waves tokens/s: {records[1]['speedup']:.3f}, longest first: {records[2]['speedup']:.3f}")
  if _PAGED.value:
    print(f"paged / contiguous tokens/s: {records[1]['speedup']:.3f} (rows in flight {records[1]['peak_rows']} vs "
          f"{records[0]['peak_rows']}, preemptions {records[1]['preemptions']})")


if __name__ == "__main__":
  flags.mark_flags_as_required(["model", "output"])
  cli.run(main)
