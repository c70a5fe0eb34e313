"""The rollout engine: the executable pool and the host loop over the step functions.

`Engine` compiles the pure functions of `tlt_jax.rollout.steps` for every batch bucket (and
prompt bucket and strategy) before a rollout starts (the JAX counterpart of TLT's CUDA-graph
pool): a rollout itself never compiles. `Engine.generate` then regains control after each
segment and harvests finished rows. With more rows than the largest bucket (continuous
batching, `EngineConfig.refill`), the batch stays at that bucket while rows wait: once a chunk
of its slots is free, their rows are harvested and waiting rows reset into them and prefilled,
so a rollout pays one tail, not one per wave. Once nothing waits, and when the active rows fit a
smaller bucket, it compacts them, so the long tail runs a small executable instead of dragging
finished rows along.

In the tail (at most `sd_max_batch` active rows) the arm, SD off or a strategy, is chosen
before every play, and a play is one segment of that arm: one executable per (bucket, strategy);
a play the bandit explores with runs a quarter of the iterations (`EngineConfig.probe_steps`).
The host syncs after each play, so its wall time and emitted tokens give the bandit a reward,
except on an executable's first run (XLA:CPU sets up its library fusions then: ~0.1 s per
executable on SmolLM2-135M, which would make that arm look several times slower than it is).

Paged (`EngineConfig.page_size`): the caches are a pool of pages shared by the rows through
page tables the host keeps (`tlt_jax.rollout.pages`) and hands to every play; rows enter when the
pool has their pages and are preempted when it runs short (see `_run`).

Guard: once a row's drafter outputs are not finite (`RowState.drafter_finite`, read with each
play's sync), the drafter's strategies are off for the rest of the rollout (suffix strategies,
which need no drafter, stay on), with a warning and `RolloutMetrics.drafter_nonfinite`; outputs
are the target's either way (the owner of the drafter restores a good one: `DrafterTrainer`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import time
from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from tlt_jax import sharding
from tlt_jax.drafter.model import Drafter
from tlt_jax.kernels import tree_attention
from tlt_jax.models import transformer
from tlt_jax.rollout import steps, suffix
from tlt_jax.rollout.bandit import Bandit
from tlt_jax.rollout.pages import Pages
from tlt_jax.rollout.pool import ExecutablePool
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.speculative import Strategy
from tlt_jax.rollout.state import (FINISH_REASONS, EngineConfig, Rollout, RolloutMetrics, RowState, Sample,
                                   SegmentRecord, SlotRows)


@flax.struct.dataclass
class _Counters:
  """Host copies of the per-row counters, refreshed by every play's sync."""

  done: np.ndarray  # bool [B]
  generated: np.ndarray  # int32 [B]
  passes: np.ndarray  # int32 [B]

  @classmethod
  def read(cls, st: RowState) -> _Counters:
    """Waits for `st` and copies its counters to the host."""
    return jax.device_get(cls(st.done, st.num_generated, st.passes))


class Engine:
  """Generates from a `CausalLM` with sampling params fixed per engine (they are compiled in).

  With a `drafter` and `config.strategies`, rows of the tail (at most `config.sd_max_batch`
  active) decode speculatively, with the one strategy or the one a `bandit` picks per segment
  (it may pick plain decoding); the output distribution is the target's either way.

  Attributes:
    config, sampling, mesh, bandit: as given.
    steps: the step functions compiled into the pool.
    params, drafter_params: the weights every executable takes (`set_params`, `set_drafter_params`).
    pool: the compiled executables, keyed by step and shapes.
  """

  def __init__(self, model: transformer.CausalLM, config: EngineConfig, params: SamplingParams,
               mesh: jax.sharding.Mesh | None = None, drafter: Drafter | None = None, bandit: Bandit | None = None):
    """Splits the models into graph and weights; compiles nothing yet (`prepare`, `generate` do).

    Args:
      model: the target; its weights are read here, `set_params` swaps them.
      config: shapes, buckets and strategies; `params.max_new_tokens` must fit its `max_new_tokens`.
      params: the sampling params of every rollout.
      mesh: rows are split over its batch axis (weights placed by the caller); None: one device.
      drafter: the EAGLE drafter, needed by non-suffix strategies.
      bandit: chooses the arm of each tail play; needed with several strategies, its arms SD off +
        `config.strategies`.

    Raises:
      ValueError: naming what does not fit together.
    """
    if params.max_new_tokens > config.max_new_tokens:
      raise ValueError(f"max_new_tokens={params.max_new_tokens} exceeds the engine's capacity "
                       f"max_new_tokens={config.max_new_tokens}")
    names = [s.name for s in config.strategies]
    eagle = [s.name for s in config.strategies if not s.suffix]
    if eagle and drafter is None:
      raise ValueError(f"speculative strategies {eagle} need a drafter (suffix strategies, 's4_1_5', do not)")
    if len(names) > 1 and bandit is None:
      raise ValueError(f"several strategies {names} need a bandit to choose between them")
    if bandit is not None and bandit.arms != (None, *config.strategies):
      raise ValueError(f"the bandit's arms must be SD off + the engine's strategies {names}")
    self.config, self.sampling, self.mesh, self.bandit = config, params, mesh, bandit
    self.page_shards = self._page_shards(config, mesh)
    graphdef, self.params = nnx.split(model)
    drafter_graphdef, self.drafter_params = nnx.split(drafter) if drafter is not None else (None, None)
    self.steps = steps.Steps(config, params, model.config, graphdef, drafter_graphdef, model.dtype)
    self.pool = ExecutablePool()
    self._ran: set[tuple] = set()  # segment executables that have run (a first run's time is no reward)

  @staticmethod
  def _page_shards(config: EngineConfig, mesh: jax.sharding.Mesh | None) -> int:
    """The equal ranges a paged pool splits into, one per device its rows split over, where the
    attention kernels run per device (each reads its rows' pages from its own range); 1 on one
    device or with attention='xla' (the jnp reference, which gathers any page anywhere). Buckets
    smaller than that are not used (`_bucket`): their rows would not split like the pages."""
    if not config.paged or mesh is None or mesh.size == 1 or \
        tree_attention.select(config.attention, jax.default_backend())[0] == "xla":
      return 1
    shape = dict(mesh.shape)
    rows = sharding.logical_spec((config.batch_buckets[-1],), ("batch",), shape)[0]
    pages = sharding.logical_spec((config.pool_pages,), ("batch",), shape)[0]
    shards = math.prod(shape[a] for a in ((rows,) if isinstance(rows, str) else rows or ()))
    if pages != rows or config.pool_pages // shards < config.pages_per_row:
      raise ValueError(f"rollout.engine.num_pages={config.pool_pages} must split into {shards} equal ranges (one per "
                       f"device the rows split over, mesh axes {rows}) of at least the {config.pages_per_row} pages "
                       f"a row fills, for attention={config.attention!r} (its kernels read each device's pages)")
    return shards

  def set_params(self, state: nnx.State) -> None:
    """Swaps in new weights of the same shapes (e.g. after an RL update); no recompilation."""
    self.params = state

  def set_drafter_params(self, state: nnx.State) -> None:
    """Swaps in new drafter weights of the same shapes; no recompilation."""
    self.drafter_params = state

  # ---- the executable pool ----

  @staticmethod
  def _abstract_slots(b: int) -> SlotRows:
    return SlotRows(*[jax.ShapeDtypeStruct((b,), jnp.int32)] * len(dataclasses.fields(SlotRows)))

  def _abstract_state(self, b: int) -> RowState:
    """The state of bucket `b`, shaped and (on a mesh) sharded as `init` makes it."""
    pages = jax.ShapeDtypeStruct((b, self.config.pages_per_row), jnp.int32) if self.config.paged else None
    state = jax.eval_shape(self.steps.init, self._abstract_slots(b), pages)
    if self.mesh is None:
      return state
    # On a mesh the executables take the state with the shardings `init` gives it.
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                        self._shardings(state))

  def _shardings(self, out: RowState) -> RowState | None:
    """Rows split over the mesh's batch axis (the caches by the cache rules, the bank replicated)."""
    if self.mesh is None:
      return None
    batch = lambda x: sharding.array_sharding(x.shape, ("batch",) + (None,) * (x.ndim - 1), self.mesh)
    shardings = jax.tree.map(batch, out.per_row())
    cache = lambda c: None if c is None else sharding.cache_shardings(c, self.mesh)
    bank = None if out.bank is None else sharding.array_sharding(out.bank.shape, (None, None), self.mesh)  # replicated
    return dataclasses.replace(shardings, cache=cache(out.cache), drafter_cache=cache(out.drafter_cache), bank=bank)

  def _compile(self, key, fn, args, out: RowState, donate=()):
    """Compiles `fn` for the abstract `args` into the pool; `out` is its abstract output (for shardings)."""
    def build():
      abstract = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                               a) for a in args]
      jitted = jax.jit(fn, donate_argnums=donate, out_shardings=self._shardings(out))
      if self.mesh is None:
        return jitted.lower(*abstract).compile()
      with jax.set_mesh(self.mesh):  # activation constraints, and Pallas kernels run per device
        return jitted.lower(*abstract).compile()
    return self.pool.get_or_compile(key, build)

  def _bucket(self, rows: int) -> int:
    """The batch bucket that holds `rows` rows: the config's, and with a pool split over devices at
    least one row per device."""
    return max(self.config.bucket(rows), self.page_shards)

  def _uses_sd(self, bucket: int) -> bool:
    """Speculation is an option at `bucket` (it holds the tail)."""
    cfg = self.config
    return bool(cfg.strategies) and bucket <= cfg.bucket(min(cfg.sd_max_batch, cfg.batch_buckets[-1]))

  def prepare(self, rows: int, prompt_lens: Sequence[int] = ()) -> None:
    """Compiles everything a rollout of `rows` rows needs (no-op for what the pool holds): with more
    rows than the largest bucket, or a paged cache (rows may wait for pages), the slot reset of
    refill (paged, also preemption's slot drop and resumption); or the smaller last wave's
    executables."""
    cfg = self.config
    largest = cfg.batch_buckets[-1]
    if rows > largest and not cfg.refill and rows % largest:
      self.prepare(rows % largest, prompt_lens)
    b0 = self._bucket(min(rows, largest))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    table = lambda b: i32(b, cfg.pages_per_row) if cfg.paged else None
    params = (self.params, self.drafter_params)
    state = self._abstract_state
    self._compile(("init", b0), self.steps.init, [self._abstract_slots(b0), table(b0)], state(b0))
    if self._refills(rows):
      self._compile(("reset", b0), self.steps.reset,
                    [state(b0), self._abstract_slots(b0), jax.ShapeDtypeStruct((cfg.bank_rows,), jnp.bool_)],
                    state(b0), donate=(0,))
    if cfg.paged:
      self._compile(("drop", b0), steps.drop, [state(b0), jax.ShapeDtypeStruct((b0,), jnp.bool_)], state(b0),
                    donate=(0,))
      for t in cfg.tail_buckets:
        self._compile(("tail", b0, t), self.steps.prefill_tail,
                      [*params, state(b0), i32(), i32(t), i32(), i32(), i32(), table(b0)], state(b0), donate=(2,))
      for r in cfg.resume_buckets:
        self._compile(("resume", b0, r), self.steps.resume,
                      [*params, state(b0), i32(), i32(r + 1), jax.ShapeDtypeStruct((r,), jnp.float32), i32(),
                       table(b0)], state(b0), donate=(2,))
    for p in self._prefill_sizes(b0, self._refills(rows)):
      for t in sorted({cfg.prompt_bucket(n) for n in prompt_lens} or set(cfg.prompt_buckets)):
        self._compile(("prefill", b0, p, t), self.steps.prefill,
                      [*params, state(b0), i32(p, t), i32(p), i32(b0), i32(p, self._history_len), i32(b0),
                       table(b0)], state(b0), donate=(2,))
    for b in cfg.batch_buckets:
      if b > b0 or (b < b0 and not cfg.compact) or b < self.page_shards:  # without compaction only b0 runs
        continue
      for s in (None, *(cfg.strategies if self._uses_sd(b) else ())):
        self._compile(self._segment_key(b, s), functools.partial(self.steps.segment, strategy=s),
                      [*params, state(b), i32(), table(b), i32()], state(b), donate=(2,))
      if b // 2 >= self.page_shards and cfg.compact:
        self._compile(("halve", b // 2, b), steps.halve, [state(b), i32(b // 2)], state(b // 2))

  @property
  def _history_len(self) -> int:
    """Tokens of history each prefilled prompt brings to its bank row (0 without a bank)."""
    return self.config.suffix_history_len if self.config.banking else 0

  def _refills(self, rows: int) -> bool:
    """A rollout of `rows` rows brings rows into slots others left: more rows than the largest bucket
    with refill, or a paged cache (rows wait for pages)."""
    cfg = self.config
    return rows > cfg.batch_buckets[-1] and cfg.refill or cfg.paged

  def _prefill_sizes(self, bucket: int, refilling: bool) -> tuple[int, ...]:
    """Unique prompts per prefill call at `bucket`: up to `prefill_batch`; in a refilling rollout
    at the largest bucket also the (power of two) size of a refill chunk and a single prompt (a
    refill of one prompt's samples, common with GRPO groups, or a preempted row coming back), so
    bringing in a few rows does not prefill a full call's padding."""
    cfg = self.config
    full = min(cfg.prefill_batch, bucket)
    if not refilling or bucket < cfg.batch_buckets[-1]:
      return (full,)
    return tuple(sorted({1, min(full, 1 << (cfg.refill_chunk - 1).bit_length()), full}))

  @staticmethod
  def _segment_key(bucket: int, strategy: Strategy | None) -> tuple:
    """The pool key of the segment executable of `strategy` (None: plain) at `bucket`."""
    return ("plain", bucket) if strategy is None else ("speculate", bucket, strategy.name)

  # ---- the host loop ----

  def generate(self, prompts: Sequence[Sequence[int]], num_samples: int = 1,
               max_total_len: Sequence[int] | int | None = None,
               on_progress: Callable[[int, int], None] | None = None, prompt_offset: int = 0,
               expected_lengths: Sequence[float] | None = None,
               history: Sequence[Sequence[int]] | None = None) -> Rollout:
    """Samples `num_samples` continuations of each prompt; compiles first what the pool lacks.

    Args:
      prompts: token ids, 1 to `config.max_prompt_len` of them each.
      num_samples: rows per prompt (a GRPO group).
      max_total_len: prompt + response length at most, one for all prompts or one per prompt;
        None: only the sampling params' `max_new_tokens` limits a row.
      on_progress: called at every segment boundary with (rows finished, tokens emitted) since the
        last call.
      prompt_offset: the prompts are a shard starting at this index of a larger batch (data-parallel
        rollout); RNG keys and `Sample.prompt_index` use the global index, so a sharded rollout
        samples exactly what one engine would.
      expected_lengths: per prompt, e.g. its mean response length in an earlier epoch; rows enter
        the batch longest expected first (ties in order) instead of in order, so the longest rows do
        not start last and stretch the tail. Order changes when a row runs, never its tokens.
      history: per prompt, tokens for the last `config.suffix_history_len` slots of its bank row
        (`suffix.History.get`: its responses in earlier epochs), which suffix strategies draft from
        too; ignored without suffix strategies. Drafts change, never tokens.

    Returns:
      `len(prompts) * num_samples` samples ordered by (prompt index, sample index), each with its n
      tokens (int32 [n], a stop token included), their log-probs (float32 [n]), why it ended and,
      when the config captures them, the features (hidden [n, H], prompt_hidden [P, H]); and the
      rollout's metrics.

    Raises:
      ValueError: a prompt is empty or too long, leaves no room under `max_total_len`, or
        `expected_lengths` or `history` does not have one entry per prompt.
    """
    cfg, sp = self.config, self.sampling
    budgets = []
    for i, p in enumerate(prompts):
      if not 0 < len(p) <= cfg.max_prompt_len:
        raise ValueError(f"prompt {i} has {len(p)} tokens; need 1..{cfg.max_prompt_len} (max_prompt_len)")
      limit = max_total_len[i] if isinstance(max_total_len, Sequence) else max_total_len
      budget = sp.max_new_tokens if limit is None else min(sp.max_new_tokens, limit - len(p))
      if budget < 1:
        raise ValueError(f"prompt {i}: {len(p)} tokens leave no room under max_total_len={limit}")
      budgets.append(budget)
    rows = [(i, j) for i in range(len(prompts)) for j in range(num_samples)]
    if expected_lengths is not None:
      if len(expected_lengths) != len(prompts):
        raise ValueError(f"expected_lengths has {len(expected_lengths)} entries for {len(prompts)} prompts")
      rows.sort(key=lambda r: -expected_lengths[r[0]])  # stable: in order among equals
    if history is not None and len(history) != len(prompts):
      raise ValueError(f"history has {len(history)} entries for {len(prompts)} prompts")
    self.prepare(len(rows), [len(p) for p in prompts])
    largest = cfg.batch_buckets[-1]
    batches = [rows] if cfg.refill else [rows[s:s + largest] for s in range(0, len(rows), largest)]
    metrics = RolloutMetrics()
    samples = []
    for batch in batches:
      samples += self._run(prompts, batch, budgets, metrics, on_progress or (lambda rows, tokens: None),
                           prompt_offset, history)
    samples.sort(key=lambda s: (s.prompt_index, s.sample_index))
    if metrics.preemptions:
      logging.info("%d rows were preempted and resumed (%d tokens prefilled again): the KV cache's %d pages ran "
                   "short (peak rows in flight %d; rollout.engine.num_pages sets the pool)", metrics.preemptions,
                   metrics.resumed_tokens, cfg.pool_pages, metrics.peak_rows)
    return Rollout(samples, metrics)

  def _bank_rows(self, rows) -> suffix.BankRows | None:
    """The bank's host bookkeeping for (prompt, sample) `rows`; None without suffix strategies."""
    cfg = self.config
    if not cfg.banking:
      return None
    layout = suffix.Layout(cfg.suffix_bank_len, cfg.max_prompt_len, 1 + max(j for _, j in rows),
                           self.sampling.max_new_tokens, cfg.suffix_history_len)
    return suffix.BankRows(layout, cfg.bank_rows, collections.Counter(i for i, _ in rows))

  def _slot_rows(self, rows, slot_row: np.ndarray, budgets, prompt_offset, bank: suffix.BankRows | None) -> SlotRows:
    """What `init` and `reset` write for the row `rows[slot_row[b]]` of each slot b (-1: none)."""
    pick = lambda f, empty: np.asarray([f(r) if r >= 0 else empty for r in slot_row], np.int32)
    places = [bank.place(*rows[r]) if bank is not None and r >= 0 else (0, 0, 0) for r in slot_row]
    bank_row, bank_offset, bank_room = np.asarray(places, np.int32).reshape(-1, 3).T
    return SlotRows(prompt_index=pick(lambda r: prompt_offset + rows[r][0], 0),
                    sample_index=pick(lambda r: rows[r][1], 0), row_id=pick(lambda r: r, -1),
                    max_new=pick(lambda r: budgets[rows[r][0]], 1), bank_row=bank_row, bank_offset=bank_offset,
                    bank_room=bank_room)

  def _prefill_slots(self, st: RowState, prompts, rows, slot_row: np.ndarray, history, write_from: np.ndarray,
                     table: np.ndarray | None, refilling: bool = False) -> RowState:
    """Prefills the rows of the slots `slot_row >= 0`: each unique prompt once per call of up to
    `prefill_batch` prompts (the smallest compiled size that holds them), written into its rows'
    caches from `write_from` on (`table`: a paged cache's page tables); `history` (per prompt, or
    None) goes to their bank rows. `refilling`: the rollout refills (`_refills`), so `prepare`
    compiled the smaller calls too."""
    b = slot_row.shape[0]
    sizes = self._prefill_sizes(b, refilling)
    unique = sorted({rows[r][0] for r in slot_row if r >= 0})
    c = 0
    while c < len(unique):
      p = next((n for n in sizes if n >= len(unique) - c), sizes[-1])
      chunk = unique[c:c + p]
      c += p
      t = self.config.prompt_bucket(max(len(prompts[i]) for i in chunk))
      tokens = np.zeros((p, t), np.int32)
      lengths = np.zeros((p,), np.int32)
      banked = np.full((p, self._history_len), -1, np.int32)
      for k, i in enumerate(chunk):
        tokens[k, :len(prompts[i])] = prompts[i]
        lengths[k] = len(prompts[i])
        if history is not None and self._history_len:
          h = np.asarray(history[i], np.int32)[:self._history_len]
          banked[k, :len(h)] = h
      slot = {i: k for k, i in enumerate(chunk)}
      row_prompt = np.asarray([slot.get(rows[r][0], -1) if r >= 0 else -1 for r in slot_row], np.int32)
      st = self.pool[("prefill", b, p, t)](self.params, self.drafter_params, st, tokens, lengths, row_prompt, banked,
                                           write_from, table)
    return st

  def _run(self, prompts, rows, budgets, metrics, on_progress, prompt_offset, history) -> list[Sample]:
    """Decodes (prompt index, sample index) `rows`, in this order of entry, until every one is done.

    The batch takes the first rows that fit the largest bucket (and, paged, the pool). While rows
    wait, it stays at that bucket: once `refill_chunk` of its slots are free (or every waiting row
    fits) the play ends on the device, the finished rows are harvested and waiting rows are
    prefilled into their slots. Each refill pays one sync and a fixed-shape prefill whatever the
    rows it brings, so waiting for a chunk amortises it while keeping the batch at least 3/4 full
    (default chunk: a quarter). Once nothing waits, the tail compacts into smaller buckets and may
    speculate.

    Paged: a row enters once the pool has its pages (its prompt's shared pages are taken by the
    first of its samples in flight), finished rows give theirs back at once, and before each play
    every active row takes the pages the play may write; a row enters only if the rows in flight
    keep a play's growth each. When the pool runs short, the rows with the fewest tokens are
    preempted: their pages freed, their tokens kept on the host, back to the front of the queue;
    when a row comes back, its prompt and its tokens are prefilled again (`Steps.resume`) and it
    goes on where it stopped. The tail compacts only once the pool holds every active row to its
    budget, so a smaller bucket never preempts. With the pool split over devices (`page_shards`),
    a slot's row takes pages on the slot's device: admission, preemption and that check count
    pages per device, and compaction keeps every row on its device.
    """
    cfg, pool = self.config, self.pool
    b = self._bucket(min(len(rows), cfg.batch_buckets[-1]))
    t0 = time.perf_counter()
    bank = self._bank_rows(rows)
    prompt_lens = [len(prompts[i]) for i, _ in rows]
    pages = Pages(cfg.pool_pages, cfg.page_size, cfg.pages_per_row, self.page_shards) if cfg.paged else None
    shards = self.page_shards
    waiting = collections.deque(range(len(rows)))
    slot_row = np.full((b,), -1)  # the host's view of which row each slot holds
    entered = np.zeros((b,), np.int64)  # when it entered (of rows as far along, preemption takes the latest)
    kept: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # a preempted row's tokens and log-probs
    clock = itertools.count()
    table = lambda: None if pages is None else pages.table(slot_row)
    b0, window = b, max([s.window for s in cfg.strategies] + [1])
    shard_of = lambda slot: slot * shards // b0  # the device range of a slot's pages (rows enter at b0 only)

    def slots_for(r: int, slots: int) -> int:  # what row r may write is bounded by its budget
      return min(slots, prompt_lens[r] + budgets[rows[r][0]] + window)

    def entry(r: int, shard: int) -> tuple:  # what admitting row r on `shard` needs: (prompt, prompt len, slots,
      # pages to leave free). Headroom: the rows already in flight keep a play's growth each, so
      # admission does not preempt them at the next play (a preempted row's tokens are prefilled again).
      play, resumed = cfg.play_slots(None), len(kept[r][0]) - 1 if r in kept else 0
      return (rows[r][0], prompt_lens[r], slots_for(r, prompt_lens[r] + resumed + play),
              pages.rows_on(shard) * -(-play // cfg.page_size), shard)

    def admit(free_slots) -> tuple[np.ndarray, np.ndarray]:
      """Waiting rows into `free_slots` while the pool has their pages: (slot -> new row, -1: none;
      the prompt slot each row's prefill writes from)."""
      new, write_from = np.full((b,), -1, np.int32), np.zeros((b,), np.int32)
      for slot in free_slots:
        if not waiting:
          break
        r = waiting[0]
        if pages is not None:
          start = pages.admit(r, *entry(r, shard_of(slot)))
          if start is None:
            continue  # another free slot's device may have its pages
          write_from[slot] = start
        waiting.popleft()
        new[slot], slot_row[slot], entered[slot] = r, r, next(clock)
      metrics.started += [rows[r] for r in new if r >= 0]
      return new, write_from

    def enter(st, new, write_from, t0):
      """Prefills the rows `admit` put in slots `new` (preempted ones: with their tokens) and counts
      them in: (state, host counters). A row whose prompt's shared pages a sibling in flight wrote
      earlier prefills only its prompt's tail after them."""
      writers = {rows[r][0] for slot, r in enumerate(new) if r >= 0 and write_from[slot] == 0}
      tails = [(slot, r) for slot, r in enumerate(new) if r >= 0 and write_from[slot] > 0 and rows[r][0] not in writers]
      full = new.copy()
      full[[slot for slot, _ in tails]] = -1
      st = self._prefill_slots(st, prompts, rows, full, history, write_from, table(), self._refills(len(rows)))
      for slot, r in tails:
        prompt, start = prompts[rows[r][0]], int(write_from[slot])
        tokens = np.zeros((cfg.tail_bucket(len(prompt) - start),), np.int32)
        tokens[:len(prompt) - start] = prompt[start:]
        sibling = next(s for s, q in enumerate(slot_row)
                       if q >= 0 and new[s] < 0 and rows[q][0] == rows[r][0] and pages.holds(q))
        st = pool[("tail", b, len(tokens))](self.params, self.drafter_params, st, np.int32(slot), tokens,
                                            np.int32(start), np.int32(len(prompt) - start), np.int32(sibling), table())
      back = [(slot, r) for slot, r in enumerate(new) if r in kept]
      for slot, r in back:
        tokens, logprobs = kept.pop(r)
        n = len(tokens)
        size = cfg.resume_bucket(n)
        tokens = np.concatenate([[prompts[rows[r][0]][-1]], tokens, np.zeros((size - n,), np.int32)]).astype(np.int32)
        logprobs = np.concatenate([logprobs, np.zeros((size - n,), np.float32)]).astype(np.float32)
        st = pool[("resume", b, size)](self.params, self.drafter_params, st, np.int32(slot), tokens, logprobs,
                                       np.int32(n), table())
        metrics.resumed_tokens += n
      host = _Counters.read(st)
      self._check_drafter(st, metrics)
      metrics.prefill_s += time.perf_counter() - t0
      entering = int((new >= 0).sum()) - len(back)  # a preempted row's tokens were counted before
      metrics.tokens += entering
      on_progress(int(host.done[new >= 0].sum()), entering)
      return st, host

    new, write_from = admit(range(b))
    st = pool[("init", b)](self._slot_rows(rows, new, budgets, prompt_offset, bank), table())
    if bank is not None:
      bank.take_fresh()  # init's bank is empty: only later prompts' rows need emptying
    st, host = enter(st, new, write_from, t0)
    out: list[Sample] = []
    harvested = np.zeros((len(rows),), bool)

    def harvest(st):
      samples = self._harvest(st, harvested, prompt_lens)
      for s in samples if bank is not None else ():  # their bank rows are free once a prompt's rows are all in
        bank.harvested(s.prompt_index - prompt_offset)
      return samples

    def play_need(slot, strategy):  # cache slots the row of `slot` may fill by the end of a play of `strategy`
      r = slot_row[slot]
      return slots_for(r, prompt_lens[r] + int(host.generated[slot]) - 1 + cfg.play_slots(strategy))

    def short(need) -> list[int]:  # the shards whose free pages cannot give each active row `need(slot)` slots
      lack = collections.Counter()
      for i in np.flatnonzero(~host.done):
        lack[pages.shard(slot_row[i])] += pages.missing(slot_row[i], prompt_lens[slot_row[i]], need(i))
      return [s for s, n in lack.items() if n > pages.free_on(s)]

    def halved(done, b) -> np.ndarray | None:
      """The slots bucket b // 2 keeps (-1: empty): each device's active rows into the first half of its
      slots, so no row changes device (with its pages); None if a device has too many."""
      per = b // shards
      keep = []
      for s in range(shards):
        active = [i for i in range(s * per, (s + 1) * per) if not done[i]]
        if len(active) > per // 2:
          return None
        keep += active + [-1] * (per // 2 - len(active))
      return np.asarray(keep, np.int32)

    while waiting or not host.done.all():
      if pages is not None:  # finished rows give their pages back at once
        for slot in np.flatnonzero(host.done & (slot_row >= 0)):
          if pages.holds(slot_row[slot]):
            pages.release(slot_row[slot])
      active = int((~host.done).sum())
      blocked = False  # rows wait for pages (to enter, or for the tail to compact), not slots
      if waiting and b - active >= min(cfg.refill_chunk, len(waiting)):
        r = waiting[0]
        if pages is None or any(pages.fits(*entry(r, s)) for s in {shard_of(i) for i in np.flatnonzero(host.done)}):
          t0 = time.perf_counter()
          out += harvest(st)
          new, write_from = admit(np.flatnonzero(host.done))
          st = pool[("reset", b)](st, self._slot_rows(rows, new, budgets, prompt_offset, bank),
                                  np.zeros((0,), bool) if bank is None else bank.take_fresh())
          st, host = enter(st, new, write_from, t0)
          metrics.refills += 1
          continue
        blocked = True
      shrink = not waiting and cfg.compact and self._bucket(active) < b
      if shrink and pages is not None and (short(lambda i: slots_for(slot_row[i], 1 << 30))
                                           or halved(host.done, b) is None):
        # The pool cannot hold the rows to their budgets yet (or, split over devices, a device's rows
        # do not fit its half): wait for one to finish.
        shrink, blocked = False, True
      if shrink:
        t0 = time.perf_counter()
        out += harvest(st)
        done = host.done
        while self._bucket(active) < b and (keep := halved(done, b)) is not None:
          st = pool[("halve", b // 2, b)](st, keep)
          done = np.where(keep >= 0, done[keep], True)
          slot_row, entered = np.where(keep >= 0, slot_row[keep], -1), entered[keep]
          b //= 2
        host = _Counters.read(st)
        metrics.compact_s += time.perf_counter() - t0
      arms = [s for s in cfg.strategies if s.suffix or not metrics.drafter_nonfinite]
      speculating = self._uses_sd(b) and bool(arms)
      tail = speculating and active <= cfg.sd_max_batch
      strategy, probe = None, False
      if tail:
        strategy, probe = (arms[0], False) if self.bandit is None else self.bandit.choose(active, arms)
      if pages is not None:  # every active row takes the pages this play may write, preempting if short
        while lacking := short(lambda i: play_need(i, strategy)):
          slots = np.asarray([i for i in np.flatnonzero(~host.done) if pages.shard(slot_row[i]) == lacking[0]])
          victim = slots[np.lexsort((-entered[slots], host.generated[slots]))[0]]  # the least work lost
          if len(slots) == 1 or b != b0:  # neither happens: a row fits the pool, the tail compacts once all fit
            raise RuntimeError(f"the page pool ({pages.num_pages} pages) cannot hold the rows of bucket {b}")
          pages.release(slot_row[victim])
          waiting.appendleft(slot_row[victim])
          k = int(host.generated[victim])
          tokens, logprobs = jax.device_get((st.tokens, st.logprobs))  # whole arrays: a slice would compile
          kept[slot_row[victim]] = tokens[victim, :k], logprobs[victim, :k]
          metrics.preemptions += 1
          slot_row[victim] = -1
          st = pool[("drop", b)](st, np.arange(b) == victim)
          host = _Counters.read(st)
          active -= 1
        for i in np.flatnonzero(~host.done):
          pages.grow(slot_row[i], prompt_lens[slot_row[i]], play_need(i, strategy))
        metrics.peak_pages = max(metrics.peak_pages, pages.held)
      metrics.peak_rows = max(metrics.peak_rows, active)
      # The play ends on the device once enough slots are free for a refill (paged, when rows wait
      # for pages, or the tail for the pages to compact: once a row finishes), or, with nothing
      # waiting, once a smaller bucket fits the active rows (compaction); before the tail, once the
      # tail begins (the bandit's turn).
      n_waiting = len(waiting)
      stop_at = b - min(cfg.refill_chunk, n_waiting) if n_waiting else (b // 2 if cfg.compact else 0)
      if blocked:
        stop_at = active - 1
      if speculating and not tail:
        stop_at = max(stop_at, cfg.sd_max_batch)
      key = self._segment_key(b, strategy)
      first_run = key not in self._ran
      self._ran.add(key)
      t0 = time.perf_counter()
      st = pool[key](self.params, self.drafter_params, st, np.int32(stop_at), table(),
                     np.int32(cfg.probe_steps if probe else cfg.segment_steps))
      before, host = host, _Counters.read(st)  # waits for the play
      seconds = time.perf_counter() - t0
      self._check_drafter(st, metrics)
      produced = int(host.generated.sum() - before.generated.sum())
      passes = host.passes - before.passes
      metrics.decode_s += seconds
      metrics.tokens += produced
      metrics.segments.append(SegmentRecord(b, active, produced, seconds, strategy and strategy.name,
                                            passes=int(passes.sum()), steps=int(passes.max()), tail=tail,
                                            waiting=n_waiting, probe=probe, first_run=first_run))
      if self.bandit is not None and tail and not first_run:
        self.bandit.update(active, strategy, produced, seconds)
      on_progress(active - int((~host.done).sum()), produced)
    return out + harvest(st)

  def _check_drafter(self, st: RowState, metrics: RolloutMetrics) -> None:
    """Turns the drafter's strategies off for the rest of the rollout once its outputs are not finite."""
    if st.drafter_finite is None or metrics.drafter_nonfinite:
      return
    finite = np.asarray(jax.device_get(st.drafter_finite))
    if not finite.all():
      metrics.drafter_nonfinite = True
      logging.warning("the drafter's outputs are not finite (NaN/inf) for %d of %d rows: its strategies are off for "
                      "the rest of this rollout (outputs are unaffected)", int((~finite).sum()), finite.size)

  def _harvest(self, st: RowState, harvested: np.ndarray, prompt_lens: Sequence[int]) -> list[Sample]:
    """Host copies of the finished rows not yet taken (before compaction drops them)."""
    host = jax.device_get(dataclasses.replace(st.per_row(), draft_feat=None))
    out = []
    for r in np.flatnonzero(host.done & (host.row_id >= 0)):
      rid = host.row_id[r]
      if harvested[rid]:
        continue
      harvested[rid] = True
      k = host.num_generated[r]
      out.append(Sample(prompt_index=int(host.prompt_index[r]), sample_index=int(host.sample_index[r]),
                        tokens=host.tokens[r, :k].copy(), logprobs=host.logprobs[r, :k].copy(),
                        finish_reason=FINISH_REASONS[host.finish[r]],
                        hidden=None if host.hidden is None else np.asarray(host.hidden[r, :k]),
                        prompt_hidden=None if host.prompt_hidden is None else
                        np.asarray(host.prompt_hidden[r, :prompt_lens[rid]])))
    return out
