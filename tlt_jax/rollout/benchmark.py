"""Rollout benchmarks, each timing modes side by side in one process (the library behind
`python -m tlt_jax.bench`, experiments/sd_grid.py, experiments/bandit.py and the notebooks; the modes
are described in tlt_jax/bench.py's docstring):

  run_grid      SD vs plain decoding per batch size and strategy (compaction off);
  run_phases    one speculative iteration split into its phases (`profile.phase_times`);
  run_adaptive  the bandit vs each of its arms alone vs plain decoding, on a long-tailed rollout;
  run_refill    continuous batching vs waves (and longest expected rows first);
  run_paged     a paged KV cache vs the contiguous one in the same bytes.

Each returns a list of JSON-able records; timings exclude compilation (a warm-up rollout first).
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
from absl import logging
from tqdm import tqdm

from tlt_jax.drafter.model import Drafter
from tlt_jax.rollout import profile, suffix
from tlt_jax.rollout.bandit import Bandit
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.state import EngineConfig


def _timed(engine: Engine, prompts, repeats: int = 3, **kwargs):
  """Metrics of `repeats` rollouts after a warm-up one (which compiles); `kwargs` go to `generate`."""
  engine.generate(prompts, **kwargs)
  return [engine.generate(prompts, **kwargs).metrics for _ in range(repeats)]


def _rounds(modes, repeats: int, desc: str, run) -> dict[str, list]:
  """`run(name, engine)` for every mode in a warm-up round (it compiles), then in `repeats` timed
  rounds, the modes interleaved so that load on the machine hits them alike; the timed results per mode."""
  runs = {name: [] for name, _ in modes}
  with tqdm(total=len(modes) * (repeats + 1), desc=desc, file=sys.stderr) as bar:
    for round_ in range(repeats + 1):  # round 0 is the warm-up
      for name, engine in modes:
        out = run(name, engine)
        if round_:
          runs[name].append(out)
        bar.update()
  return runs


def _median(rollouts):
  """The rollout of the median tokens/s."""
  return rollouts[int(np.argsort([r.metrics.tokens_per_s for r in rollouts])[len(rollouts) // 2])]


def _rollout_speed(engine: Engine, prompts, **kwargs) -> tuple[float, float]:
  """Median decode tokens/s and the acceptance length."""
  runs = _timed(engine, prompts, **kwargs)
  return float(np.median([sum(s.tokens for s in m.segments) / m.decode_s for m in runs])), runs[0].accept_len


def run_adaptive(model, drafter: Drafter | None, prompts, strategies, temperature, max_new_tokens, seed, stop_ids,
                 sd_max_batch, repeats, num_samples: int = 1):
  """Plain vs each fixed strategy vs the bandit on one long-tailed rollout of `prompts` x `num_samples`;
  `compilations`: what each mode's timed rollouts compiled (the warm-up one compiles its engine)."""
  buckets = tuple(2**i for i in range(int(np.ceil(np.log2(len(prompts) * num_samples))) + 1))
  base = EngineConfig(batch_buckets=buckets, max_prompt_len=max(map(len, prompts)), max_new_tokens=max_new_tokens,
                      sd_max_batch=sd_max_batch)
  params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                          stop_token_ids=tuple(stop_ids))
  bandit = Bandit(strategies, seed=seed)
  # "sd_off" is the bandit's SD-off arm played alone: the same engine, its drafter kept current for a
  # switch that never comes. "plain" has no drafter at all: the gap between the two is that upkeep.
  modes = [("plain", Engine(model, base, params)), ("sd_off", Engine(model, base, params, drafter=drafter))]
  modes += [(s.name, Engine(model, EngineConfig(**{**base.__dict__, "strategies": (s,)}), params, drafter=drafter))
            for s in strategies]
  modes.append(("bandit", Engine(model, EngineConfig(**{**base.__dict__, "strategies": tuple(strategies)}), params,
                                 drafter=drafter, bandit=bandit)))
  runs, compiled = {name: [] for name, _ in modes}, {name: 0 for name, _ in modes}
  with tqdm(total=len(modes) * (repeats + 1), desc="bench --adaptive", file=sys.stderr) as bar:
    for round_ in range(repeats + 1):  # round 0 is the warm-up
      for name, engine in modes:
        with profile.count_compilations() as compiles:
          m = engine.generate(prompts, num_samples).metrics
        if round_:
          runs[name].append(m)
          compiled[name] += len(compiles)
        bar.update()
      if not round_:
        warmup_plays = sum(arm["plays"] for b in bandit.stats().values() for arm in b.values())
  records, median = [], {}
  for name, _ in modes:
    ms = runs[name]
    median[name] = m = ms[int(np.argsort([r.tokens_per_s for r in ms])[len(ms) // 2])]
    records.append({"mode": name, "tokens_per_s": round(m.tokens_per_s, 2),
                    "tokens_per_s_rounds": [round(r.tokens_per_s, 2) for r in ms], "accept_len": round(m.accept_len, 3),
                    "sd_share": round(m.sd_s / m.wall_s, 3), "compilations": compiled[name]})
  for r in records:
    r["speedup"] = round(r["tokens_per_s"] / records[0]["tokens_per_s"], 3)
  fixed = [r["tokens_per_s"] for r in records[1:-1]]  # the bandit's arms, each played alone
  total_plays = sum(arm["plays"] for b in bandit.stats().values() for arm in b.values())
  m = median["bandit"]
  # What learning costs in a short run: exploring plays, and an arm's first play at a bucket (its
  # executable's one-time setup; the warm-up round runs only the arms the bandit chose). The rest
  # is the rate of its choices.
  learning = [s for s in m.segments if s.probe or s.first_run]
  learning_s = sum(s.seconds for s in learning)
  settled = (m.tokens - sum(s.tokens for s in learning)) / max(m.wall_s - learning_s, 1e-9)
  records[-1].update(vs_best_fixed=round(records[-1]["tokens_per_s"] / max(fixed), 3),
                     vs_worst_fixed=round(records[-1]["tokens_per_s"] / min(fixed), 3),
                     learning_share=round(learning_s / m.wall_s, 3),
                     settled_vs_best_fixed=round(settled / max(fixed), 3),
                     warmup_plays=warmup_plays, timed_plays=total_plays - warmup_plays, summary=m.summary(),
                     bandit=bandit.stats())
  return records


def run_refill(model, prompts, num_samples, bucket, temperature, max_new_tokens, seed, stop_ids, repeats):
  """Waves vs refill (rows in order) vs refill with the longest expected rows first, on one rollout of
  len(prompts) x num_samples rows through a largest bucket of `bucket`. A prompt's expected length is
  its mean response length in the warm-up round: the lengths a scheduler would know exactly (the
  same seed), so `longest_first` is that policy's best case."""
  base = EngineConfig(batch_buckets=tuple(2**i for i in range(bucket.bit_length())),
                      max_prompt_len=max(map(len, prompts)), max_new_tokens=max_new_tokens)
  params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                          stop_token_ids=tuple(stop_ids))
  refill = Engine(model, base, params)
  modes = [("waves", Engine(model, EngineConfig(**{**base.__dict__, "refill": False}), params)),
           ("refill", refill), ("longest_first", refill)]
  expected = None

  def run(name, engine):
    nonlocal expected
    rollout = engine.generate(prompts, num_samples, expected_lengths=expected if name == "longest_first" else None)
    if expected is None:
      expected = [float(np.mean([len(s.tokens) for s in rollout.samples if s.prompt_index == i]))
                  for i in range(len(prompts))]
    return rollout

  runs = _rounds(modes, repeats, "bench --refill", run)
  records = []
  for name, _ in modes:
    r = _median(runs[name])
    lengths = [len(s.tokens) for s in r.samples]
    m = r.metrics
    records.append({"mode": name, "rows": len(r.samples), "bucket": bucket, "tokens_per_s": round(m.tokens_per_s, 2),
                    "wall_s": round(m.wall_s, 3), "refills": m.refills,
                    "idle_slot_fraction": round(m.idle_slot_fraction, 3), "tail_share": round(m.tail_share, 3),
                    "p99_over_median": round(float(np.percentile(lengths, 99) / np.median(lengths)), 2)})
  tokens = {name: sorted((s.prompt_index, s.sample_index, s.tokens.tolist()) for s in rs[0].samples)
            for name, rs in runs.items()}
  for r in records:  # refill and its order change when a row runs, never its tokens
    r.update(speedup=round(r["tokens_per_s"] / records[0]["tokens_per_s"], 3),
             same_samples=tokens[r["mode"]] == tokens["waves"])
  return records


def run_paged(model, prompts, num_samples, bucket, paged_bucket, page_size, temperature, max_new_tokens, seed,
              stop_ids, repeats):
  """The contiguous cache of `bucket` rows vs a paged cache of the same bytes (`page_size`-slot
  pages, up to `paged_bucket` rows in flight) on one rollout of len(prompts) x num_samples rows,
  plain decoding with refill, interleaved over `repeats` timed rounds after a warm-up one. The
  paged cache also holds each prompt's full pages once for its samples, where the contiguous cache
  writes a copy per row."""
  buckets = lambda n: tuple(2**i for i in range(n.bit_length()))
  contiguous = EngineConfig(batch_buckets=buckets(bucket), max_prompt_len=max(map(len, prompts)),
                            max_new_tokens=max_new_tokens, kv_block=page_size)
  cache_slots = bucket * contiguous.capacity
  paged = EngineConfig(**{**contiguous.__dict__, "batch_buckets": buckets(paged_bucket), "page_size": page_size})
  paged = EngineConfig(**{**paged.__dict__, "num_pages": cache_slots // page_size})
  params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                          stop_token_ids=tuple(stop_ids))
  modes = [("contiguous", Engine(model, contiguous, params)), ("paged", Engine(model, paged, params))]
  runs = _rounds(modes, repeats, "bench --paged", lambda name, engine: engine.generate(prompts, num_samples))
  records = []
  for name, engine in modes:
    r = _median(runs[name])
    m, c = r.metrics, engine.config
    records.append({"mode": name, "rows": len(r.samples), "cache_slots": c.pool_pages * c.page_size if c.paged
                    else c.batch_buckets[-1] * c.capacity, "tokens_per_s": round(m.tokens_per_s, 2),
                    "wall_s": round(m.wall_s, 3), "prefill_s": round(m.prefill_s, 3),
                    "prefill_ms_per_row": round(1e3 * m.prefill_s / len(r.samples), 2), "peak_rows": m.peak_rows,
                    "preemptions": m.preemptions, "resumed_tokens": m.resumed_tokens, "refills": m.refills,
                    "mean_response_len": round(float(np.mean([len(s.tokens) for s in r.samples])), 1)})
  tokens = {name: sorted((s.prompt_index, s.sample_index, s.tokens.tolist()) for s in rs[0].samples)
            for name, rs in runs.items()}
  for r in records:
    r.update(speedup=round(r["tokens_per_s"] / records[0]["tokens_per_s"], 3),
             same_samples=tokens[r["mode"]] == tokens["contiguous"])
  return records


def run_grid(model, drafter: Drafter | None, prompts, batch_sizes, strategies, temperature, max_new_tokens, seed,
             stop_ids, num_samples: int = 1, history_len: int = 0, rows: int = 0):
  """SD vs plain decoding per batch size b and strategy (compaction off): the rollout of
  ceil(max(b, rows) / num_samples) prompts x `num_samples` samples with at most b rows at once
  (refilled): `rows` beyond b measure a batch size over more prompts.

  With `history_len`, each suffix strategy is also timed with each prompt's history (`suffix.History`)
  holding its responses of an earlier rollout sampled with another seed (an earlier epoch of an
  unchanged policy), as `<strategy>+history`.
  """
  records = []
  top = max(batch_sizes)
  buckets = tuple(2**i for i in range(int(np.ceil(np.log2(top))) + 1))
  base = EngineConfig(batch_buckets=buckets, max_prompt_len=max(map(len, prompts)), max_new_tokens=max_new_tokens,
                      segment_steps=32, compact=False)
  params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                          stop_token_ids=tuple(stop_ids))
  arms = [(s, 0) for s in strategies] + [(s, history_len) for s in strategies if s.suffix and history_len]
  with tqdm(total=len(batch_sizes) * (len(arms) + 1), desc="bench", file=sys.stderr) as bar:
    for b in batch_sizes:
      sized = lambda config: EngineConfig(**{**config.__dict__, "batch_buckets": buckets[:(b - 1).bit_length() + 1]})
      batch = prompts[:-(-max(b, rows) // num_samples)]
      baseline, _ = _rollout_speed(Engine(model, sized(base), params), batch, num_samples=num_samples)
      bar.update()
      banked = None
      if history_len and any(s.suffix for s in strategies):  # the earlier rollout, once per batch
        earlier = Engine(model, sized(base), dataclasses.replace(params, seed=seed + 1)).generate(batch, num_samples)
        bank = suffix.History(history_len, base.suffix_ngram)
        for i, prompt in enumerate(batch):
          bank.add(prompt, [s.tokens for s in earlier.samples if s.prompt_index == i])
        banked = [bank.get(p) for p in batch]
      for strategy, history in arms:
        config = sized(EngineConfig(**{**base.__dict__, "strategies": (strategy,), "sd_max_batch": top,
                                       "suffix_history_len": history}))
        kwargs = {"num_samples": num_samples, **({"history": banked} if history else {})}
        speed, accept_len = _rollout_speed(Engine(model, config, params, drafter=drafter), batch, **kwargs)
        records.append({"batch_size": b, "rows": len(batch) * num_samples,
                        "strategy": strategy.name + ("+history" if history else ""),
                        "verify_tokens": strategy.verify_tokens, "tokens_per_s": round(speed, 2),
                        "baseline_tokens_per_s": round(baseline, 2), "speedup": round(speed / baseline, 3),
                        "accept_len": round(accept_len, 3)})
        bar.update()
  return records


def run_phases(model, drafter: Drafter, prompts, batch_sizes, strategies, temperature, max_new_tokens, seed):
  """`profile.phase_times` per batch size and strategy (rows never stop: every phase runs on all of them).
  A reduced-vocabulary drafter is timed twice, its own head beside the same layers with the full one."""
  records = []
  params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
  heads = [(drafter.vocab_size, drafter)] + ([(model.config.vocab_size, drafter.with_full_vocab())]
                                             if drafter.draft_vocab else [])
  with tqdm(total=len(batch_sizes) * len(strategies) * len(heads), desc="bench --phases", file=sys.stderr) as bar:
    for b in batch_sizes:
      batch = prompts[:b]
      for strategy in strategies:
        buckets = tuple(2**i for i in range((b - 1).bit_length() + 1))
        config = EngineConfig(batch_buckets=buckets, max_prompt_len=max(map(len, batch)), max_new_tokens=max_new_tokens,
                              segment_steps=16, compact=False, strategies=(strategy,), sd_max_batch=b)
        for vocab, d in heads:
          times = profile.phase_times(Engine(model, config, params, drafter=d), batch, strategy)
          records.append({"batch_size": b, "strategy": strategy.name, "draft_vocab": vocab, **times})
          bar.update()
  return records


def plot_acceptance(records: list[dict], path: str) -> str | None:
  """A PNG of the grid's tokens accepted per verify against verify tokens, a line per temperature (EAGLE
  strategies, no history) at the smallest batch size; None, one logged line, without matplotlib."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel  (optional)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    logging.warning("no acceptance figure: matplotlib is not installed (pip install matplotlib)")
    return None
  batch = min(r["batch_size"] for r in records)
  fig, ax = plt.subplots(figsize=(6, 4))
  for t in sorted({r["temperature"] for r in records}):
    cells = sorted((r for r in records if r["temperature"] == t and r["batch_size"] == batch
                    and not r["strategy"].startswith("s") and "+" not in r["strategy"]),
                   key=lambda r: r["verify_tokens"])
    if cells:
      ax.plot([r["verify_tokens"] for r in cells], [r["accept_len"] for r in cells], marker="o",
              label="greedy" if t == 0 else f"T = {t:g}")
      for r in cells:
        ax.annotate(f"{r['speedup']:.2f}x", (r["verify_tokens"], r["accept_len"]), fontsize=7,
                    textcoords="offset points", xytext=(3, 3))
  ax.set(xlabel="verify tokens per iteration", ylabel="tokens accepted per verify",
         title=f"acceptance vs tree size, batch {batch} (labels: speed-up over plain on this machine)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
