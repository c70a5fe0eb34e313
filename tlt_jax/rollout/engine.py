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
pool has their pages and are preempted when it runs short (`tlt_jax.rollout.schedule`).

Tool turns (`Engine(turns=...)`, `tlt_jax.rollout.tools`): a row that ends an assistant turn hands
it to `Turns.submit`; a turn with tool calls keeps the row in its slot, its cache kept, while the
other rows decode on (the play's stop count leaves the waiting rows out), and once the calls are
back their tokens are appended (`Steps.extend`: every returned row at once, in chunks of
`EngineConfig.turn_chunk` tokens, one executable per bucket) and the row decodes its next turn.
When every row in the batch waits for its tools (and none can enter), the host waits for the
first to come back.

Guard: once a row's drafter outputs are not finite (`RowState.drafter_finite`, read with each
play's sync), the drafter's strategies are off for the rest of the rollout (suffix strategies,
which need no drafter, stay on), with a warning and `RolloutMetrics.drafter_nonfinite`; outputs
are the target's either way (the owner of the drafter restores a good one: `DrafterTrainer`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
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
from tlt_jax.executables import ExecutablePool
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.schedule import Schedule, bucket_for
from tlt_jax.rollout.speculative import Strategy
from tlt_jax.rollout.state import (FINISH_REASONS, EngineConfig, Rollout, RolloutMetrics, RowState, Sample,
                                   SegmentRecord, SlotRows)
from tlt_jax.rollout.tools import Turns


@flax.struct.dataclass
class _Counters:
  """Host copies of the per-row counters, refreshed by every play's sync."""

  done: np.ndarray  # bool [B]
  generated: np.ndarray  # int32 [B]
  passes: np.ndarray  # int32 [B]
  finish: np.ndarray  # int32 [B], into FINISH_REASONS

  @classmethod
  def read(cls, st: RowState) -> _Counters:
    """Waits for `st` and copies its counters to the host."""
    return jax.device_get(cls(st.done, st.num_generated, st.passes, st.finish))


@dataclasses.dataclass
class _Job:
  """One `_run`: its rows and what they read (the prompts, per prompt `budgets` and `history`), where
  its outputs go (the samples harvested, the metrics, the progress callback) and the bank's rows."""

  prompts: Sequence[Sequence[int]]
  rows: list[tuple[int, int]]  # (prompt index, sample index), in order of entry
  budgets: list[int]
  prompt_offset: int
  history: Sequence[Sequence[int]] | None
  bank: suffix.BankRows | None
  metrics: RolloutMetrics
  on_progress: Callable[[int, int], None]
  out: list[Sample] = dataclasses.field(default_factory=list)
  prompt_lens: list[int] = dataclasses.field(init=False)  # per row
  harvested: np.ndarray = dataclasses.field(init=False)  # bool per row
  # Tool turns, per row: where its current turn began, its turns so far, the generated count of its last
  # turn end seen, its calls in flight, the (start, count) of each tool turn appended, its calls'
  # records, and the rows whose tool turn did not fit their budget.
  turn_start: collections.defaultdict = dataclasses.field(default_factory=lambda: collections.defaultdict(int))
  turns: collections.defaultdict = dataclasses.field(default_factory=lambda: collections.defaultdict(lambda: 1))
  seen: dict[int, int] = dataclasses.field(default_factory=dict)
  pending: dict[int, concurrent.futures.Future] = dataclasses.field(default_factory=dict)
  spans: collections.defaultdict = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
  calls: collections.defaultdict = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
  cut: set[int] = dataclasses.field(default_factory=set)

  def __post_init__(self):
    self.prompt_lens = [len(self.prompts[i]) for i, _ in self.rows]
    self.harvested = np.zeros((len(self.rows),), bool)


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
               mesh: jax.sharding.Mesh | None = None, drafter: Drafter | None = None, bandit: Bandit | None = None,
               turns: Turns | None = None):
    """Splits the models into graph and weights; compiles nothing yet (`prepare`, `generate` do).

    Args:
      model: the target; its weights are read here, `set_params` swaps them.
      config: shapes, buckets and strategies; `params.max_new_tokens` must fit its `max_new_tokens`.
      params: the sampling params of every rollout.
      mesh: rows are split over its batch axis (weights placed by the caller); None: one device.
      drafter: the EAGLE drafter, needed by non-suffix strategies.
      bandit: chooses the arm of each tail play; needed with several strategies, its arms SD off +
        `config.strategies`.
      turns: runs the tool calls of the rows' turns (module docstring); None: a row ends at its stop token.

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
    self.config, self.sampling, self.mesh, self.bandit, self.turns = config, params, mesh, bandit, turns
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
    smaller than that are not used (`schedule.bucket_for`): their rows would not split like the pages."""
    if not config.paged or mesh is None or mesh.size == 1 or \
        tree_attention.select(config.attention, mesh.devices.flat[0].platform)[0] == "xla":
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

  def _shardings(self, out: RowState | jax.ShapeDtypeStruct) -> RowState | jax.sharding.Sharding | None:
    """Rows split over the mesh's batch axis (the caches by the cache rules, the bank replicated); an abstract
    array's own."""
    if self.mesh is None or isinstance(out, jax.ShapeDtypeStruct):
      return None if self.mesh is None else out.sharding
    batch = lambda x: sharding.array_sharding(x.shape, ("batch",) + (None,) * (x.ndim - 1), self.mesh)
    shardings = jax.tree.map(batch, out.per_row())
    cache = lambda c: None if c is None else sharding.cache_shardings(c, self.mesh)
    bank = None if out.bank is None else sharding.array_sharding(out.bank.shape, (None, None), self.mesh)  # replicated
    return dataclasses.replace(shardings, cache=cache(out.cache), drafter_cache=cache(out.drafter_cache), bank=bank)

  def _compile(self, key, fn, args, out: RowState | jax.ShapeDtypeStruct, donate=()):
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
    b0 = bucket_for(cfg, min(rows, largest), self.page_shards)
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
        apart = self._values_apart
        self._compile(("halve", b // 2, b), steps.halve, [apart(state(b)), i32(b // 2)], apart(state(b // 2)))
        if not cfg.paged:
          self._compile(("take_rows", b // 2, b), steps.take_rows, [state(b).cache.v, i32(b // 2)],
                        state(b // 2).cache.v)
      if self.turns is not None:
        self._compile(("extend", b), self.steps.extend, [*params, state(b), i32(b, cfg.turn_chunk), i32(b), table(b)],
                      state(b), donate=(2,))

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
      samples += self._run(_Job(prompts, batch, budgets, prompt_offset, history, self._bank_rows(batch), metrics,
                                on_progress or (lambda rows, tokens: None)))
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

  def _run(self, job: _Job) -> list[Sample]:
    """Decodes `job.rows`, in this order of entry, until every one is done: each turn refills free
    slots with waiting rows, or compacts the tail, chooses an arm, reserves the play's pages and
    plays (`tlt_jax.rollout.schedule` takes the host's decisions)."""
    cfg = self.config
    sched = Schedule(cfg, job.rows, job.prompt_lens, [job.budgets[i] for i, _ in job.rows], self.page_shards)
    t0 = time.perf_counter()
    new, write_from, slots = self._admit(job, sched, range(sched.bucket))
    st = self.pool[("init", sched.bucket)](slots, sched.table())
    if job.bank is not None:
      job.bank.take_fresh()  # init's bank is empty: only later prompts' rows need emptying
    st, host = self._enter(job, sched, st, new, write_from, t0)
    while not sched.finished:
      sched.release_finished()
      if job.pending:
        st, host = self._return_turns(job, sched, st, host, wait=host.done.all() and not sched.refill_ready())
      if sched.refill_ready():
        st, host = self._refill(job, sched, st)
        continue
      if sched.compactable():
        st, host = self._compact(job, sched, st)
      if job.pending and host.done.all():  # every row in the batch waits for its tools
        continue
      active = sched.active
      arms = [s for s in cfg.strategies if s.suffix or not job.metrics.drafter_nonfinite]
      speculating = self._uses_sd(sched.bucket) and bool(arms)
      tail = speculating and active <= cfg.sd_max_batch
      strategy, probe = None, False
      if tail:
        strategy, probe = (arms[0], False) if self.bandit is None else self.bandit.choose(active, arms)
      st = self._reserve(job, sched, st, strategy)
      st, host = self._play(job, sched, st, host, strategy, probe, tail, speculating and not tail)
    return job.out + self._harvest(job, st)

  def _admit(self, job: _Job, sched: Schedule, free_slots) -> tuple[np.ndarray, np.ndarray, SlotRows]:
    """`Schedule.admit`, with what `init` or `reset` writes for the slots."""
    new, write_from = sched.admit(free_slots)
    job.metrics.started += [job.rows[r] for r in new if r >= 0]
    return new, write_from, self._slot_rows(job.rows, new, job.budgets, job.prompt_offset, job.bank)

  def _enter(self, job: _Job, sched: Schedule, st: RowState, new: np.ndarray, write_from: np.ndarray,
             t0: float) -> tuple[RowState, _Counters]:
    """Prefills the rows `admit` put in slots `new` (preempted ones: with their tokens) and counts
    them in: (state, host counters). A row whose prompt's shared pages a sibling in flight wrote
    earlier prefills only its prompt's tail after them."""
    cfg, b, metrics = self.config, sched.bucket, job.metrics
    whole, tails, back = sched.prefills(new, write_from)
    st = self._prefill_slots(st, job.prompts, job.rows, whole, job.history, write_from, sched.table(),
                             self._refills(len(job.rows)))
    for slot, start, sibling in tails:
      prompt = job.prompts[job.rows[new[slot]][0]]
      tokens = np.zeros((cfg.tail_bucket(len(prompt) - start),), np.int32)
      tokens[:len(prompt) - start] = prompt[start:]
      st = self.pool[("tail", b, len(tokens))](self.params, self.drafter_params, st, np.int32(slot), tokens,
                                               np.int32(start), np.int32(len(prompt) - start), np.int32(sibling),
                                               sched.table())
    for slot, tokens, logprobs in back:
      n = len(tokens)
      size = cfg.resume_bucket(n)
      tokens = np.concatenate([[job.prompts[job.rows[new[slot]][0]][-1]], tokens,
                               np.zeros((size - n,), np.int32)]).astype(np.int32)
      logprobs = np.concatenate([logprobs, np.zeros((size - n,), np.float32)]).astype(np.float32)
      st = self.pool[("resume", b, size)](self.params, self.drafter_params, st, np.int32(slot), tokens, logprobs,
                                          np.int32(n), sched.table())
      metrics.resumed_tokens += n
    host = self._observe(job, sched, st)
    metrics.prefill_s += time.perf_counter() - t0
    entering = int((new >= 0).sum()) - len(back)  # a preempted row's tokens were counted before
    metrics.tokens += entering
    job.on_progress(int(host.done[new >= 0].sum()), entering)
    return st, host

  def _refill(self, job: _Job, sched: Schedule, st: RowState) -> tuple[RowState, _Counters]:
    """Harvests the finished rows and prefills waiting ones into their slots."""
    t0 = time.perf_counter()
    job.out += self._harvest(job, st)
    new, write_from, slots = self._admit(job, sched, np.flatnonzero(sched.done))
    fresh = np.zeros((0,), bool) if job.bank is None else job.bank.take_fresh()  # bank rows to empty
    st = self.pool[("reset", sched.bucket)](st, slots, fresh)
    job.metrics.refills += 1
    return self._enter(job, sched, st, new, write_from, t0)

  def _compact(self, job: _Job, sched: Schedule, st: RowState) -> tuple[RowState, _Counters]:
    """Harvests the finished rows and gathers the active ones into smaller buckets."""
    t0 = time.perf_counter()
    job.out += self._harvest(job, st)
    b = sched.bucket
    for keep in sched.compact():
      st = self._halve(st, keep, b)
      b //= 2
    host = self._observe(job, sched, st, check=False)
    job.metrics.compact_s += time.perf_counter() - t0
    return st, host

  def _values_apart(self, st: RowState) -> RowState:
    """The state as `steps.halve` takes it: a contiguous target cache without its values."""
    return st if self.config.paged else dataclasses.replace(st, cache=dataclasses.replace(st.cache, v=None))

  def _halve(self, st: RowState, keep: np.ndarray, b: int) -> RowState:
    """The rows of bucket b's slots `keep` into bucket b // 2. A contiguous target cache's keys are gathered
    with the rest and their old array freed before its values are: the peak holds the cache and half of one
    array, not half of both."""
    halved = self.pool[("halve", b // 2, b)](self._values_apart(st), keep)
    if self.config.paged:
      return halved
    st.cache.k.delete()
    v = self.pool[("take_rows", b // 2, b)](st.cache.v, keep)
    st.cache.v.delete()
    return dataclasses.replace(halved, cache=dataclasses.replace(halved.cache, v=v))

  def _reserve(self, job: _Job, sched: Schedule, st: RowState, strategy: Strategy | None) -> RowState:
    """Every active row takes the pages a play of `strategy` may write, preempting rows while the
    pool is short."""
    metrics = job.metrics
    if sched.pages is not None:
      while (victim := sched.victim(strategy)) is not None:
        k = int(sched.generated[victim])
        tokens, logprobs = jax.device_get((st.tokens, st.logprobs))  # whole arrays: a slice would compile
        sched.preempt(victim, tokens[victim, :k], logprobs[victim, :k])
        st = self.pool[("drop", sched.bucket)](st, np.arange(sched.bucket) == victim)
        metrics.preemptions += 1
      sched.reserve(strategy)
      metrics.peak_pages = max(metrics.peak_pages, sched.pages.held)
    metrics.peak_rows = max(metrics.peak_rows, sched.active)
    return st

  def _play(self, job: _Job, sched: Schedule, st: RowState, before: _Counters, strategy: Strategy | None,
            probe: bool, tail: bool, before_tail: bool) -> tuple[RowState, _Counters]:
    """One play of `strategy` (None: plain) until `sched.stop_at`, recorded (and rewarded to the
    bandit, but on an executable's first run)."""
    cfg, b, active, metrics = self.config, sched.bucket, sched.active, job.metrics
    key = self._segment_key(b, strategy)
    first_run = key not in self._ran
    self._ran.add(key)
    t0 = time.perf_counter()
    stop_at = max(sched.stop_at(before_tail) - len(sched.held), 0)  # rows waiting for tools are done on the device
    st = self.pool[key](self.params, self.drafter_params, st, np.int32(stop_at), sched.table(),
                        np.int32(cfg.probe_steps if probe else cfg.segment_steps))
    host = self._observe(job, sched, st)  # waits for the play
    seconds = time.perf_counter() - t0
    produced = int(host.generated.sum() - before.generated.sum())
    passes = host.passes - before.passes
    metrics.decode_s += seconds
    metrics.tokens += produced
    metrics.segments.append(SegmentRecord(b, active, produced, seconds, strategy and strategy.name,
                                          passes=int(passes.sum()), steps=int(passes.max()), tail=tail,
                                          waiting=len(sched.waiting), probe=probe, first_run=first_run))
    if self.bandit is not None and tail and not first_run:
      self.bandit.update(active, strategy, produced, seconds, int(passes.max()))
    job.on_progress(active - sched.active, produced)
    return st, host

  def _observe(self, job: _Job, sched: Schedule, st: RowState, check: bool = True) -> _Counters:
    """Waits for `st`, hands its counters to the schedule (rows waiting for tools as active) and, with
    `check`, starts the tool calls of the turns that ended and checks the drafter's outputs."""
    host = _Counters.read(st)
    if check and self.turns is not None:
      self._end_turns(job, sched, st, host)
    held = np.isin(sched.slot_row, list(sched.held))
    sched.observe(host.done & ~held, host.generated)
    if check:
      self._check_drafter(st, job.metrics)
    return host

  # ---- tool turns ----

  def _end_turns(self, job: _Job, sched: Schedule, st: RowState, host: _Counters) -> None:
    """Hands every turn that ended with the row's stop token since the last look to `Turns.submit`;
    a row whose turn calls tools waits for them (`sched.held`), the others are finished."""
    tokens = None
    for slot in np.flatnonzero(host.done & (host.finish == FINISH_REASONS.index("stop"))):
      r, k = int(sched.slot_row[slot]), int(host.generated[slot])
      if r < 0 or r in sched.held or job.seen.get(r) == k:
        continue
      job.seen[r] = k
      if job.turns[r] >= self.turns.max_turns:
        continue
      if tokens is None:
        tokens = np.asarray(jax.device_get(st.tokens))  # whole: a slice would compile
      future = self.turns.submit(tokens[slot, job.turn_start[r]:k].copy())
      if future is not None:
        job.pending[r] = future
        sched.held.add(r)

  def _return_turns(self, job: _Job, sched: Schedule, st: RowState, host: _Counters,
                    wait: bool) -> tuple[RowState, _Counters]:
    """Appends the tool turns that are back to their rows, which decode on; `wait`: first waits for one.
    A turn that leaves its row no token of its budget ends the row ("length") without it."""
    metrics, t0 = job.metrics, time.perf_counter()
    if wait:
      concurrent.futures.wait(job.pending.values(), return_when=concurrent.futures.FIRST_COMPLETED)
      metrics.tool_wait_s += time.perf_counter() - t0
    t1, changed, appended = time.perf_counter(), False, {}
    for r, future in sorted(job.pending.items()):
      if not future.done():
        continue
      turn = future.result()
      slot, n = int(np.flatnonzero(sched.slot_row == r)[0]), len(turn.tokens)
      k = int(host.generated[slot])
      fits = k + n < job.budgets[job.rows[r][0]]
      if fits and not sched.take_turn(slot, n):
        continue  # its pages free up as other rows finish
      del job.pending[r]
      sched.held.discard(r)
      job.calls[r] += turn.calls
      metrics.tool_calls += len(turn.calls)
      changed = True
      if not fits:
        job.cut.add(r)
        continue
      appended[slot] = np.asarray(turn.tokens, np.int32)
      job.spans[r].append((k, n))
      job.turn_start[r], job.turns[r] = k + n, job.turns[r] + 1
      metrics.tool_turns += 1
      metrics.tool_tokens += n
    if wait and not changed and all(f.done() for f in job.pending.values()):
      raise RuntimeError(f"the page pool ({self.config.pool_pages} pages) cannot hold the tool turns of the rows "
                         "waiting for them: raise rollout.engine.num_pages")
    if appended:
      st = self._extend(sched, st, appended)
    if changed:
      host = self._observe(job, sched, st)
    metrics.tool_append_s += time.perf_counter() - t1
    return st, host

  def _extend(self, sched: Schedule, st: RowState, appended: dict[int, np.ndarray]) -> RowState:
    """Appends each slot's tool-turn tokens to its row: all rows at once, `turn_chunk` tokens a call."""
    b, c = sched.bucket, self.config.turn_chunk
    for i in range(0, max(map(len, appended.values())), c):
      tokens, count = np.zeros((b, c), np.int32), np.zeros((b,), np.int32)
      for slot, turn in appended.items():
        part = turn[i:i + c]
        tokens[slot, :len(part)], count[slot] = part, len(part)
      st = self.pool[("extend", b)](self.params, self.drafter_params, st, tokens, count, sched.table())
    return st

  def _check_drafter(self, st: RowState, metrics: RolloutMetrics) -> None:
    """Turns the drafter's strategies off for the rest of the rollout once its outputs are not finite."""
    if st.drafter_finite is None or metrics.drafter_nonfinite:
      return
    finite = np.asarray(jax.device_get(st.drafter_finite))
    if not finite.all():
      metrics.drafter_nonfinite = True
      logging.warning("the drafter's outputs are not finite (NaN/inf) for %d of %d rows: its strategies are off for "
                      "the rest of this rollout (outputs are unaffected)", int((~finite).sum()), finite.size)

  def _harvest(self, job: _Job, st: RowState) -> list[Sample]:
    """Host copies of the finished rows not yet taken (before compaction drops them)."""
    host = jax.device_get(dataclasses.replace(st.per_row(), draft_feat=None))
    out = []
    for r in np.flatnonzero(host.done & (host.row_id >= 0)):
      rid = host.row_id[r]
      if job.harvested[rid] or rid in job.pending:
        continue
      job.harvested[rid] = True
      k = host.num_generated[r]
      mask = None
      if self.turns is not None:
        mask = np.zeros((k,), bool)
        for start, n in job.spans[rid]:
          mask[start:start + n] = True
      out.append(Sample(prompt_index=int(host.prompt_index[r]), sample_index=int(host.sample_index[r]),
                        tokens=host.tokens[r, :k].copy(), logprobs=host.logprobs[r, :k].copy(),
                        finish_reason="length" if rid in job.cut else FINISH_REASONS[host.finish[r]],
                        tool_mask=mask, tool_calls=list(job.calls[rid]),
                        hidden=None if host.hidden is None else np.asarray(host.hidden[r, :k]),
                        prompt_hidden=None if host.prompt_hidden is None else
                        np.asarray(host.prompt_hidden[r, :job.prompt_lens[rid]])))
    for sample in out if job.bank is not None else ():  # bank rows are free once a prompt's rows are all in
      job.bank.harvested(sample.prompt_index - job.prompt_offset)
    return out
