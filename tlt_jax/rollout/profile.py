"""Where a speculative iteration's time goes: each phase compiled and timed alone on a real state.

`phase_times(engine, prompts, strategy)` prefills `prompts` (one row each) with the engine's own
executables, then times, as separate jitted functions on that state (median of `repeats` runs
after a warm-up, each waited for):

  draft      the EAGLE-2 tree: the drafter's levels and its head (full or reduced vocabulary)
  verify     the target over the tree, acceptance (sampling) and the KV commit
  feed       the drafter over the accepted pairs (its cache, the next root's feature)
  iteration  the three together, one jitted function: what the fused loop runs per iteration
  plain      one plain decoding step (the one-node tree), the baseline per token
  segment    the engine's own speculative segment executable, per iteration (its host call and
             sync included, over `segment_steps` iterations)

`segment - iteration` is what the host and the loop cost per iteration; `iteration - (draft +
verify + feed)` what fusing saves.

`count_compilations()` counts what XLA compiles while a block runs: a rollout after its engine's
`prepare` should count none (a rollout never compiles: `tlt_jax.rollout.engine`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Iterator, Sequence

import jax
import numpy as np

from tlt_jax.rollout import speculative
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.speculative import Strategy

# jax.monitoring's event per executable compiled, or loaded from the persistent compilation cache.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compilations() -> Iterator[list[str]]:
  """Yields a list that gets the function's name of every executable XLA compiles while the block runs
  (jitted, AOT-compiled or an eager op's; loaded from the persistent cache counts too, since tracing
  and lowering ran again). Process-wide: other threads' compilations count."""
  names: list[str] = []

  def listen(event: str, secs: float, **kwargs) -> None:
    del secs
    if event == COMPILE_EVENT:
      names.append(str(kwargs.get("fun_name", "?")))

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def _median_s(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def prefilled_state(engine: Engine, prompts: Sequence[Sequence[int]]):
  """The engine's state after prefilling `prompts` (one row each; empty rows pad it to its bucket) into
  its contiguous cache."""
  if engine.config.paged:
    raise ValueError("the phases are timed over a contiguous cache (page_size=0)")
  n = len(prompts)
  b = engine.config.bucket(n)
  engine.prepare(n, [len(p) for p in prompts])
  rows = [(i, 0) for i in range(n)]
  slots = np.asarray(list(range(n)) + [-1] * (b - n), np.int32)
  st = engine.pool[("init", b)](engine._slot_rows(rows, slots, [engine.sampling.max_new_tokens] * n, 0,
                                                  engine._bank_rows(rows)), None)
  return engine._prefill_slots(st, prompts, rows, slots, None, np.zeros((b,), np.int32), None)


def phase_times(engine: Engine, prompts: Sequence[Sequence[int]], strategy: Strategy,
                repeats: int = 10) -> dict[str, float]:
  """Milliseconds per phase of one speculative iteration at batch len(prompts); see the module docstring."""
  cfg, steps = engine.config, engine.steps
  st = prefilled_state(engine, prompts)
  params = (engine.params, engine.drafter_params)

  def draft(p, d, st):
    model, drafter = steps.models(p, d)
    return steps.draft(model, drafter, drafter.head(model), st, strategy)

  def verify(p, d, st, tree, dcache):
    model, drafter = steps.models(p, d)
    return steps.verify_step(model, drafter, dataclasses.replace(st, drafter_cache=dcache), tree, strategy.depth)

  def feed(p, d, st, pairs):
    model, drafter = steps.models(p, d)
    return steps.feed_drafter(model, drafter, st, pairs, cfg.kv_block)

  def iteration(p, d, st):
    verified = verify(p, d, st, *draft(p, d, st))
    return feed(p, d, verified.state, verified.pairs)

  def plain(p, d, st):
    model, drafter = steps.models(p, d)
    return steps.verify_step(model, drafter, st, speculative.root_only(st.last_token), 0).state

  draft, verify, feed, iteration, plain = (jax.jit(f) for f in (draft, verify, feed, iteration, plain))
  tree, dcache = draft(*params, st)
  verified = verify(*params, st, tree, dcache)
  ms = lambda fn, *args: 1e3 * _median_s(fn, (*params, *args), repeats)
  out = {"draft": ms(draft, st), "verify": ms(verify, st, tree, dcache),
         "feed": ms(feed, verified.state, verified.pairs),
         "iteration": ms(iteration, st), "plain": ms(plain, st)}
  segment = engine.pool[engine._segment_key(cfg.bucket(len(prompts)), strategy)]

  def run_segment():
    state = jax.tree.map(lambda x: x.copy(), st)  # the executable donates its state
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    done = segment(*params, state, np.int32(0), None, np.int32(cfg.segment_steps))
    passes, generated = jax.device_get((done.passes, done.num_generated))  # waits, as the host loop's sync does
    return time.perf_counter() - t0, passes.sum(), generated.sum() - int(jax.device_get(st.num_generated).sum())

  run_segment()
  runs = [run_segment() for _ in range(max(repeats // 3, 3))]
  out["segment"] = 1e3 * float(np.median([s * len(prompts) / max(n, 1) for s, n, _ in runs]))
  out["accept_len"] = float(runs[0][2] / max(runs[0][1], 1))
  return {k: round(v, 3) for k, v in out.items()}
