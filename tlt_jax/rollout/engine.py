"""The rollout engine: jitted prefill and decode segments over explicit state, with long-tail compaction.

Functional core: `RowState` (KV cache, last token, per-row counters, outputs) goes through pure
functions compiled ahead of time for every batch bucket: `init`, `prefill` (a chunk of unique
prompts, copied into each of their sample rows: GRPO groups share one prefill), `segment`
(up to `segment_steps` decode steps in a `lax.while_loop`) and `halve` (compaction into the
next smaller bucket). Imperative shell: `Engine.generate` regains control between segments,
harvests finished rows, and when the active rows fit a smaller bucket it compacts them, so the
long tail runs a small executable instead of dragging finished rows along.

Every executable a rollout needs is compiled before it starts (the JAX counterpart of TLT's
CUDA-graph pool); a rollout itself never compiles.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax import sharding
from tlt_jax.models import transformer
from tlt_jax.models.transformer import KVCache
from tlt_jax.rollout import sampling
from tlt_jax.rollout.pool import ExecutablePool
from tlt_jax.rollout.sampling import SamplingParams

FINISH_REASONS = ("running", "stop", "length")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # powers of two
  max_prompt_len: int = 256
  max_new_tokens: int = 256  # capacity; a rollout's SamplingParams may ask for fewer
  segment_steps: int = 16  # decode steps between host checks
  kv_block: int = 64  # attention block; the cache capacity is rounded up to a multiple
  prefill_batch: int = 16  # unique prompts per prefill call
  compact: bool = True
  capture_hidden: bool = False  # keep the target's last hidden state of every generated token
  compilation_cache_dir: str | None = None  # persistent XLA cache: later processes skip compiling

  def __post_init__(self):
    b = self.batch_buckets
    if not b or b[0] != 1 or any(y != 2 * x for x, y in zip(b, b[1:])):
      raise ValueError(f"batch_buckets must be 1, 2, 4, ... (powers of two), got {b}")

  @property
  def capacity(self) -> int:
    return -(-(self.max_prompt_len + self.max_new_tokens) // self.kv_block) * self.kv_block

  @property
  def prompt_buckets(self) -> tuple[int, ...]:
    """Padded prompt lengths: powers of two from 16, the last one max_prompt_len itself."""
    sizes = [16]
    while sizes[-1] < self.max_prompt_len:
      sizes.append(sizes[-1] * 2)
    return tuple(min(s, self.max_prompt_len) for s in sizes)

  def bucket(self, rows: int) -> int:
    return next(b for b in self.batch_buckets if b >= rows)


@flax.struct.dataclass
class RowState:
  cache: KVCache
  last_token: jax.Array  # [B] the token to feed next
  num_generated: jax.Array  # [B]
  max_new: jax.Array  # [B] per-row budget (max new tokens, max total length)
  done: jax.Array  # [B] bool; empty slots are done from the start
  finish: jax.Array  # [B] index into FINISH_REASONS
  prompt_index: jax.Array  # [B] these three make the row's identity and its RNG keys
  sample_index: jax.Array  # [B]
  row_id: jax.Array  # [B] output row, -1 for an empty slot
  tokens: jax.Array  # [B, N]
  logprobs: jax.Array  # [B, N] log-prob of each token under the sampling distribution
  hidden: jax.Array | None  # [B, N, H] feature that produced token i (EAGLE's f_t for x_{t+1})


@dataclasses.dataclass
class Sample:
  prompt_index: int
  sample_index: int
  tokens: np.ndarray  # int32 [n], the stop token included when one ended the row
  logprobs: np.ndarray  # float32 [n]
  finish_reason: str  # "stop" or "length"
  hidden: np.ndarray | None = None  # [n, H] when the engine captures hidden states


@dataclasses.dataclass
class SegmentRecord:
  bucket: int
  active_rows: int
  tokens: int
  seconds: float


@dataclasses.dataclass
class RolloutMetrics:
  prefill_s: float = 0.0
  decode_s: float = 0.0
  compact_s: float = 0.0
  tokens: int = 0
  segments: list[SegmentRecord] = dataclasses.field(default_factory=list)

  @property
  def wall_s(self) -> float:
    return self.prefill_s + self.decode_s + self.compact_s

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / max(self.wall_s, 1e-9)

  def buckets(self) -> list[int]:
    return [s.bucket for s in self.segments]


@dataclasses.dataclass
class Rollout:
  samples: list[Sample]  # ordered by (prompt_index, sample_index)
  metrics: RolloutMetrics


def _where_rows(mask_B, new, old):
  return jnp.where(mask_B.reshape(mask_B.shape + (1,) * (new.ndim - 1)), new, old)


class Engine:
  """Generates from a `CausalLM` with sampling params fixed per engine (they are compiled in)."""

  def __init__(self, model: transformer.CausalLM, config: EngineConfig, params: SamplingParams,
               mesh: jax.sharding.Mesh | None = None):
    if params.max_new_tokens > config.max_new_tokens:
      raise ValueError(f"max_new_tokens={params.max_new_tokens} exceeds the engine's capacity "
                       f"max_new_tokens={config.max_new_tokens}")
    self.config, self.sampling, self.mesh = config, params, mesh
    if config.compilation_cache_dir:
      jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    self.model_config = model.config
    self.graphdef, self.params = nnx.split(model)
    self.pool = ExecutablePool()
    self._dtype = model.model.embed_tokens.embedding.dtype

  def set_params(self, state: nnx.State) -> None:
    """Swaps in new weights of the same shapes (e.g. after an RL update); no recompilation."""
    self.params = state

  # ---- pure functions (compiled per shape) ----

  def _init(self, prompt_index, sample_index, row_id, max_new):
    cfg, mc = self.config, self.model_config
    b, n = prompt_index.shape[0], self.sampling.max_new_tokens
    zeros = jnp.zeros((b,), jnp.int32)
    return RowState(
        cache=KVCache.zeros(mc, b, cfg.capacity, self._dtype), last_token=zeros, num_generated=zeros,
        max_new=max_new, done=row_id < 0, finish=zeros, prompt_index=prompt_index,
        sample_index=sample_index, row_id=row_id, tokens=jnp.zeros((b, n), jnp.int32),
        logprobs=jnp.zeros((b, n), jnp.float32),
        hidden=jnp.zeros((b, n, mc.hidden_size), self._dtype) if cfg.capture_hidden else None)

  def _emit(self, st: RowState, active, logits, hidden):
    """Samples each active row's next token from `logits` and records it."""
    sp = self.sampling
    keys = sampling.row_keys(sp.seed, st.prompt_index, st.sample_index, st.num_generated)
    tok, lp = sampling.sample(sampling.log_probs(logits, sp), keys, sp)
    rows = jnp.arange(tok.shape[0])
    pos = jnp.where(active, st.num_generated, st.tokens.shape[1])  # out of bounds: dropped
    n_gen = st.num_generated + active
    stop = active & jnp.isin(tok, jnp.asarray(sp.stop_token_ids, jnp.int32))
    length = active & ~stop & (n_gen >= st.max_new)
    return dataclasses.replace(
        st, last_token=jnp.where(active, tok, st.last_token), num_generated=n_gen,
        done=st.done | stop | length, finish=jnp.where(stop, 1, jnp.where(length, 2, st.finish)),
        tokens=st.tokens.at[rows, pos].set(tok, mode="drop"),
        logprobs=st.logprobs.at[rows, pos].set(lp, mode="drop"),
        hidden=None if st.hidden is None else st.hidden.at[rows, pos].set(hidden.astype(st.hidden.dtype),
                                                                          mode="drop"))

  def _prefill(self, params, st: RowState, tokens_PxT, lengths_P, row_prompt_B):
    """Prefills P unique prompts and copies each into its rows (row_prompt_B >= 0)."""
    model = nnx.merge(self.graphdef, params)
    p, t = tokens_PxT.shape
    out = transformer.prefill(model, tokens_PxT, lengths_P, KVCache.zeros(self.model_config, p, t, self._dtype))
    sel, src = row_prompt_B >= 0, jnp.maximum(row_prompt_B, 0)
    k = _where_rows(sel, jnp.moveaxis(out.cache.k[:, src], 1, 0), jnp.moveaxis(st.cache.k[:, :, :t], 1, 0))
    v = _where_rows(sel, jnp.moveaxis(out.cache.v[:, src], 1, 0), jnp.moveaxis(st.cache.v[:, :, :t], 1, 0))
    cache = KVCache(k=st.cache.k.at[:, :, :t].set(jnp.moveaxis(k, 0, 1)),
                    v=st.cache.v.at[:, :, :t].set(jnp.moveaxis(v, 0, 1)),
                    lengths=jnp.where(sel, lengths_P[src], st.cache.lengths))
    last_hidden = jnp.take_along_axis(out.hidden, jnp.maximum(lengths_P - 1, 0)[:, None, None], axis=1)[:, 0]
    return self._emit(dataclasses.replace(st, cache=cache), sel, out.logits[src], last_hidden[src])

  def _segment(self, params, st: RowState):
    """Up to `segment_steps` decode steps; stops early once every row is done."""
    model = nnx.merge(self.graphdef, params)

    def step(carry):
      i, st = carry
      active = ~st.done
      out = transformer.decode(model, st.last_token, st.cache, kv_block=self.config.kv_block)
      cache = dataclasses.replace(out.cache, lengths=jnp.where(active, out.cache.lengths, st.cache.lengths))
      return i + 1, self._emit(dataclasses.replace(st, cache=cache), active, out.logits, out.hidden)

    cond = lambda carry: (carry[0] < self.config.segment_steps) & ~jnp.all(carry[1].done)
    return jax.lax.while_loop(cond, step, (jnp.int32(0), st))[1]

  @staticmethod
  def _halve(st: RowState, keep_b):
    """Gathers rows `keep_b` (half the bucket; -1 = empty slot) into a state half the size."""
    src = jnp.maximum(keep_b, 0)
    take = lambda x: None if x is None else x[src]
    out = jax.tree.map(take, dataclasses.replace(st, cache=None))
    cache = KVCache(k=st.cache.k[:, src], v=st.cache.v[:, src], lengths=st.cache.lengths[src])
    empty = keep_b < 0
    return dataclasses.replace(out, cache=cache, done=out.done | empty, row_id=jnp.where(empty, -1, out.row_id))

  # ---- the executable pool ----

  def _abstract_state(self, b: int) -> RowState:
    i32 = jax.ShapeDtypeStruct((b,), jnp.int32)
    return jax.eval_shape(self._init, i32, i32, i32, i32)

  def _state_shardings(self, state: RowState):
    if self.mesh is None:
      return None
    batch = lambda x: sharding.array_sharding(x.shape, ("batch",) + (None,) * (x.ndim - 1), self.mesh)
    shardings = jax.tree.map(batch, dataclasses.replace(state, cache=None))
    return dataclasses.replace(shardings, cache=sharding.cache_shardings(state.cache, self.mesh))

  def _compile(self, key, fn, args, out_bucket, donate=()):
    def build():
      abstract = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                               a) for a in args]
      out_state = self._state_shardings(self._abstract_state(out_bucket))
      jitted = jax.jit(fn, donate_argnums=donate, out_shardings=out_state)
      return jitted.lower(*abstract).compile()
    return self.pool.get_or_compile(key, build)

  def prepare(self, rows: int, prompt_lens: Sequence[int] = ()) -> None:
    """Compiles everything a rollout of `rows` rows needs (no-op for what the pool holds)."""
    cfg = self.config
    b0 = cfg.bucket(rows)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    self._compile(("init", b0), self._init, [i32(b0)] * 4, b0)
    p = min(cfg.prefill_batch, b0)
    for t in sorted({self._prompt_bucket(n) for n in prompt_lens} or set(cfg.prompt_buckets)):
      self._compile(("prefill", b0, p, t), self._prefill,
                    [self.params, self._abstract_state(b0), i32(p, t), i32(p), i32(b0)], b0, donate=(1,))
    for b in cfg.batch_buckets:
      if b <= b0:
        self._compile(("segment", b), self._segment, [self.params, self._abstract_state(b)], b, donate=(1,))
        if b > 1 and cfg.compact:
          self._compile(("halve", b // 2, b), self._halve, [self._abstract_state(b), i32(b // 2)], b // 2)

  def _prompt_bucket(self, n: int) -> int:
    return next(t for t in self.config.prompt_buckets if t >= n)

  # ---- the host loop ----

  def generate(self, prompts: Sequence[Sequence[int]], num_samples: int = 1,
               max_total_len: Sequence[int] | int | None = None,
               on_progress: Callable[[int, int], None] | None = None) -> Rollout:
    """Samples `num_samples` continuations of each prompt (token ids).

    `on_progress(rows_finished_delta, tokens_delta)` is called at every segment boundary.
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
    wave = cfg.batch_buckets[-1]
    metrics = RolloutMetrics()
    samples = []
    for start in range(0, len(rows), wave):
      chunk = rows[start:start + wave]
      self.prepare(len(chunk), [len(prompts[i]) for i, _ in chunk])
      samples += self._wave(prompts, chunk, budgets, metrics, on_progress or (lambda rows, tokens: None))
    samples.sort(key=lambda s: (s.prompt_index, s.sample_index))
    return Rollout(samples, metrics)

  def _wave(self, prompts, rows, budgets, metrics, on_progress) -> list[Sample]:
    """One batch of (prompt index, sample index) rows, from prefill until every row is done."""
    cfg, pool = self.config, self.pool
    b = cfg.bucket(len(rows))
    pad = lambda xs, fill: np.asarray(list(xs) + [fill] * (b - len(xs)), np.int32)
    t0 = time.perf_counter()
    st = pool[("init", b)](pad([i for i, _ in rows], 0), pad([j for _, j in rows], 0), pad(range(len(rows)), -1),
                           pad([budgets[i] for i, _ in rows], 1))
    unique = sorted({i for i, _ in rows})
    p = min(cfg.prefill_batch, b)
    for c in range(0, len(unique), p):
      chunk = unique[c:c + p]
      t = self._prompt_bucket(max(len(prompts[i]) for i in chunk))
      tokens = np.zeros((p, t), np.int32)
      lengths = np.zeros((p,), np.int32)
      for k, i in enumerate(chunk):
        tokens[k, :len(prompts[i])] = prompts[i]
        lengths[k] = len(prompts[i])
      slot = {i: k for k, i in enumerate(chunk)}
      row_prompt = pad([slot.get(i, -1) for i, _ in rows], -1)
      st = pool[("prefill", b, p, t)](self.params, st, tokens, lengths, row_prompt)
    done = np.asarray(st.done)
    metrics.prefill_s += time.perf_counter() - t0
    metrics.tokens += len(rows)
    on_progress(int(done[:len(rows)].sum()), len(rows))
    out: list[Sample] = []
    harvested = np.zeros((len(rows),), bool)
    while not done.all():
      active = int((~done).sum())
      if cfg.compact and cfg.bucket(active) < b:
        t0 = time.perf_counter()
        out += self._harvest(st, harvested)
        while cfg.bucket(active) < b:
          keep = np.flatnonzero(~done)
          keep = np.concatenate([keep, np.full((b // 2 - len(keep),), -1)]).astype(np.int32)
          st = pool[("halve", b // 2, b)](st, keep)
          done = np.concatenate([done[keep[keep >= 0]], np.ones((b // 2 - (keep >= 0).sum(),), bool)])
          b //= 2
        jax.block_until_ready(st)
        metrics.compact_s += time.perf_counter() - t0
      t0 = time.perf_counter()
      before = int(np.sum(np.asarray(st.num_generated)))
      st = pool[("segment", b)](self.params, st)
      done = np.asarray(st.done)
      produced = int(np.sum(np.asarray(st.num_generated))) - before
      seconds = time.perf_counter() - t0
      metrics.decode_s += seconds
      metrics.tokens += produced
      metrics.segments.append(SegmentRecord(b, active, produced, seconds))
      on_progress(active - int((~done).sum()), produced)
    return out + self._harvest(st, harvested)

  def _harvest(self, st: RowState, harvested: np.ndarray) -> list[Sample]:
    """Host copies of the finished rows not yet taken (before compaction drops them)."""
    host = jax.device_get(dataclasses.replace(st, cache=None))
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
                        hidden=None if host.hidden is None else np.asarray(host.hidden[r, :k])))
    return out
