"""Rollout benchmarks, each timing modes side by side in one process (the library behind
`python -m tlt_jax.bench`, experiments/sd_grid.py, experiments/bandit.py and the notebooks; the modes
are described in tlt_jax/bench.py's docstring):

  run_grid      SD vs plain decoding per batch size and strategy (compaction off);
  run_phases    one speculative iteration split into its phases (`profile.phase_times`);
  run_adaptive  the bandit vs each of its arms alone vs plain decoding, on a long-tailed rollout;
  run_refill    continuous batching vs waves (and longest expected rows first).

Each returns a list of JSON-able records; timings exclude compilation (a warm-up rollout first).
"""

from __future__ import annotations

import sys

import numpy as np
from tqdm import tqdm

from tlt_jax.drafter.model import Drafter
from tlt_jax.rollout import profile
from tlt_jax.rollout.bandit import Bandit
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.state import EngineConfig


def _timed(engine: Engine, prompts, repeats: int = 3):
  """Metrics of `repeats` rollouts after a warm-up one (which compiles)."""
  engine.generate(prompts)
  return [engine.generate(prompts).metrics for _ in range(repeats)]


def _rollout_speed(engine: Engine, prompts) -> tuple[float, float]:
  """Median decode tokens/s and the acceptance length."""
  runs = _timed(engine, prompts)
  return float(np.median([sum(s.tokens for s in m.segments) / m.decode_s for m in runs])), runs[0].accept_len


def run_adaptive(model, drafter: Drafter, prompts, strategies, temperature, max_new_tokens, seed, stop_ids,
                 sd_max_batch, repeats):
  """Plain vs each fixed strategy vs the bandit on one long-tailed rollout."""
  buckets = tuple(2**i for i in range(int(np.ceil(np.log2(len(prompts)))) + 1))
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
  runs = {name: [] for name, _ in modes}
  with tqdm(total=len(modes) * (repeats + 1), desc="bench --adaptive", file=sys.stderr) as bar:
    for round_ in range(repeats + 1):  # round 0 is the warm-up
      for name, engine in modes:
        m = engine.generate(prompts).metrics
        if round_:
          runs[name].append(m)
        bar.update()
      if not round_:
        warmup_plays = sum(arm["plays"] for b in bandit.stats().values() for arm in b.values())
  records, median = [], {}
  for name, _ in modes:
    ms = runs[name]
    median[name] = m = ms[int(np.argsort([r.tokens_per_s for r in ms])[len(ms) // 2])]
    records.append({"mode": name, "tokens_per_s": round(m.tokens_per_s, 2), "accept_len": round(m.accept_len, 3),
                    "sd_share": round(m.sd_s / m.wall_s, 3)})
  for r in records:
    r["speedup"] = round(r["tokens_per_s"] / records[0]["tokens_per_s"], 3)
  fixed = [r["tokens_per_s"] for r in records[1:-1]]  # the bandit's arms, each played alone
  total_plays = sum(arm["plays"] for b in bandit.stats().values() for arm in b.values())
  records[-1].update(vs_best_fixed=round(records[-1]["tokens_per_s"] / max(fixed), 3),
                     vs_worst_fixed=round(records[-1]["tokens_per_s"] / min(fixed), 3), warmup_plays=warmup_plays,
                     timed_plays=total_plays - warmup_plays, summary=median["bandit"].summary(), bandit=bandit.stats())
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
  runs, expected = {name: [] for name, _ in modes}, None
  with tqdm(total=len(modes) * (repeats + 1), desc="bench --refill", file=sys.stderr) as bar:
    for round_ in range(repeats + 1):  # round 0 is the warm-up
      for name, engine in modes:
        rollout = engine.generate(prompts, num_samples, expected_lengths=expected if name == "longest_first" else None)
        if expected is None:
          expected = [float(np.mean([len(s.tokens) for s in rollout.samples if s.prompt_index == i]))
                      for i in range(len(prompts))]
        if round_:
          runs[name].append(rollout)
        bar.update()
  records = []
  for name, _ in modes:
    rs = runs[name]
    r = rs[int(np.argsort([x.metrics.tokens_per_s for x in rs])[len(rs) // 2])]
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


def run_grid(model, drafter: Drafter, prompts, batch_sizes, strategies, temperature, max_new_tokens, seed, stop_ids):
  records = []
  top = max(batch_sizes)
  buckets = tuple(2**i for i in range(int(np.ceil(np.log2(top))) + 1))
  base = EngineConfig(batch_buckets=buckets, max_prompt_len=max(map(len, prompts)), max_new_tokens=max_new_tokens,
                      segment_steps=32, compact=False)
  params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                          stop_token_ids=tuple(stop_ids))
  plain = Engine(model, base, params)
  with tqdm(total=len(batch_sizes) * (len(strategies) + 1), desc="bench", file=sys.stderr) as bar:
    for b in batch_sizes:
      batch = prompts[:b]
      baseline, _ = _rollout_speed(plain, batch)
      bar.update()
      for strategy in strategies:
        config = EngineConfig(**{**base.__dict__, "strategies": (strategy,), "sd_max_batch": top})
        speed, accept_len = _rollout_speed(Engine(model, config, params, drafter=drafter), batch)
        records.append({"batch_size": b, "strategy": strategy.name, "tokens_per_s": round(speed, 2),
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
