"""The rollout engine: jitted prefill and decode segments over explicit state, with long-tail compaction.

Functional core: `RowState` (KV caches, last token, per-row counters, outputs) goes through pure
functions compiled ahead of time for every batch bucket: `init`, `prefill` (a chunk of unique
prompts, copied into each of their sample rows: GRPO groups share one prefill), the segments
(one `lax.while_loop` of up to `segment_steps` iterations: plain decoding steps, or speculative
iterations of one strategy), `halve` (compaction into the next smaller bucket) and `reset`
(empties chosen slots for new rows). Imperative shell: `Engine.generate` regains control after
each segment and harvests finished rows. With more rows than the largest bucket (continuous
batching, `EngineConfig.refill`), the batch stays at that bucket while rows wait: once a chunk
of its slots is free, their rows are harvested and waiting rows reset into them and prefilled,
so a rollout pays one tail, not one per wave. Once nothing waits, and when the active rows fit a
smaller bucket, it compacts them, so the long tail runs a small executable instead of dragging
finished rows along. A segment ends on the device as soon as either point is reached.

One verify function serves plain and speculative decoding: a plain step verifies the one-node
tree (the last token), a speculative iteration drafts an EAGLE-2 tree, verifies it, accepts with
`speculative.accept`, commits the accepted path's keys/values and feeds the committed (feature,
token) pairs to the drafter, all inside the loop: the host never drives a speculative step. A
plain segment feeds the drafter once at its end (one chunked pass), so the drafter cache is
current whenever the tail switches speculation on.

Suffix strategies draft without a model (`tlt_jax.rollout.suffix`): every prompt in flight holds
a row of `RowState.bank` (its prompt and its samples' tokens, written as they are accepted), which
follows prompts, not slots: compaction and refill move rows, the bank stays, and a prompt's bank
row is emptied for another prompt only after its last row is harvested. Their trees go through
the same verify step; with a drafter, its feed goes on, so an EAGLE arm can play next.

In the tail (at most `sd_max_batch` active rows) the arm, SD off or a strategy, is chosen
before every play, and a play is one segment of that arm: one executable per (bucket, strategy).
The host syncs after each play, so its wall time and emitted tokens give the bandit a reward.

Guard: every drafter feed also records whether the drafter's outputs stayed finite
(`RowState.drafter_finite`, read with each play's sync). Once a row's are not (NaN/inf drafter
params or draft logits), speculation is off for the rest of the rollout, with a warning and
`RolloutMetrics.drafter_nonfinite`; outputs are the target's either way (the owner of the
drafter restores a good one, e.g. `SpotTrainer`).

Every executable a rollout needs is compiled before it starts (the JAX counterpart of TLT's
CUDA-graph pool); a rollout itself never compiles.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from tlt_jax import fields
from tlt_jax import sharding
from tlt_jax.kernels import tree_attention
from tlt_jax.models import transformer
from tlt_jax.models.transformer import KVCache
from tlt_jax.drafter.model import Drafter
from tlt_jax.rollout import speculative, suffix
from tlt_jax.rollout.bandit import Bandit
from tlt_jax.rollout.pool import ExecutablePool
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.speculative import Strategy

FINISH_REASONS = ("running", "stop", "length")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """What the engine compiles for. Config: `rollout.engine` (max_prompt_len from `data`, max_new_tokens from
  `rollout.sampling`, strategies from `rollout.strategies`)."""

  batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # powers of two
  max_prompt_len: int = 256
  max_new_tokens: int = 256  # capacity; a rollout's SamplingParams may ask for fewer
  segment_steps: int = 16  # decode steps between host checks
  kv_block: int = 64  # attention block; the cache capacity is rounded up to a multiple
  attention: str = "auto"  # tree-attention implementation (`tlt_jax.kernels.tree_attention.select`)
  prefill_batch: int = 16  # unique prompts per prefill call
  compact: bool = True
  capture_hidden: bool = False  # keep the target's last hidden state of every prompt and generated token
  compilation_cache_dir: str | None = None  # persistent XLA cache: later processes skip compiling
  strategies: tuple[Strategy, ...] = ()  # draft strategies for the tail (EAGLE ones need a drafter; several: a bandit)
  sd_max_batch: int = 32  # speculate while at most this many rows are active (TLT: 32)
  # More rows than the largest bucket: True keeps that batch full, prefilling waiting rows into
  # finished rows' slots (one tail per rollout); False runs them in consecutive waves (one tail each).
  refill: bool = True
  refill_rows: int = 0  # refill once this many slots are free (0: a quarter of the largest bucket)
  # Suffix strategies: each prompt in flight banks its prompt and its samples' tokens in this many
  # slots (`tlt_jax.rollout.suffix`); a row's last `suffix_ngram` tokens at most are matched there.
  suffix_bank_len: int = 4096
  suffix_ngram: int = 4

  def __post_init__(self):
    b = self.batch_buckets
    fields.require(b and b[0] == 1 and all(y == 2 * x for x, y in zip(b, b[1:])), "batch_buckets", b,
                   "must be 1, 2, 4, ... (powers of two)")
    fields.require(self.attention in tree_attention.IMPLEMENTATIONS, "attention", self.attention,
                   f"must be one of {tree_attention.IMPLEMENTATIONS}")
    fields.at_least(self, 1, "max_prompt_len", "max_new_tokens", "segment_steps", "kv_block", "prefill_batch",
                    "sd_max_batch", "suffix_ngram")
    fields.at_least(self, 2, "suffix_bank_len")  # a prompt token and a generated one
    fields.require(0 <= self.refill_rows <= b[-1], "refill_rows", self.refill_rows,
                   f"must be in [0, {b[-1]}] (the largest bucket)")
    fields.require(not self.banking or self.suffix_bank_len >= self.max_prompt_len + 2, "suffix_bank_len",
                   self.suffix_bank_len,
                   f"must be >= max_prompt_len + 2 = {self.max_prompt_len + 2} (the prompt and a token)")

  @property
  def banking(self) -> bool:
    """Rows bank their tokens for suffix strategies."""
    return any(s.suffix for s in self.strategies)

  @property
  def bank_rows(self) -> int:
    """Prompts in flight at most: the largest batch + 1 (see `suffix.BankRows`); 0 without suffix strategies."""
    return self.batch_buckets[-1] + 1 if self.banking else 0

  @property
  def capacity(self) -> int:
    """Cache slots per row: prompt, response, and the tree slots a step writes past the length."""
    window = max([s.window for s in self.strategies] + [1])
    return -(-(self.max_prompt_len + self.max_new_tokens + window) // self.kv_block) * self.kv_block

  @property
  def prompt_buckets(self) -> tuple[int, ...]:
    """Padded prompt lengths: powers of two from 16, the last one max_prompt_len itself."""
    sizes = [16]
    while sizes[-1] < self.max_prompt_len:
      sizes.append(sizes[-1] * 2)
    return tuple(min(s, self.max_prompt_len) for s in sizes)

  def bucket(self, rows: int) -> int:
    return next(b for b in self.batch_buckets if b >= rows)

  @property
  def refill_chunk(self) -> int:
    return self.refill_rows or max(1, self.batch_buckets[-1] // 4)


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
  prompt_hidden: jax.Array | None  # [B, max_prompt_len, H] the prompt's features f_0..f_{P-1}
  passes: jax.Array  # [B] target forward passes (verify steps) while active
  drafter_cache: KVCache | None  # one layer; pairs (f_p, x_{p+1}) for every committed position p
  draft_feat: jax.Array | None  # [B, H] drafter output for the last committed pair
  drafter_finite: jax.Array | None  # [B] bool: every drafter output of the row was finite
  bank: jax.Array | None  # [bank_rows, suffix_bank_len] token bank per prompt in flight (not per row)
  bank_row: jax.Array | None  # [B] the row's prompt's bank row
  bank_offset: jax.Array | None  # [B] where the row's own tokens start in it
  bank_room: jax.Array | None  # [B] how many of them it holds


@flax.struct.dataclass
class Pairs:
  """Committed (feature, token) pairs for the drafter: pair j of row b is (f_p, x_{p+1})."""

  features: jax.Array  # [B, M, H]
  tokens: jax.Array  # [B, M]
  count: jax.Array  # [B] valid pairs per row (the first `count`)


@dataclasses.dataclass
class Sample:
  prompt_index: int
  sample_index: int
  tokens: np.ndarray  # int32 [n], the stop token included when one ended the row
  logprobs: np.ndarray  # float32 [n]
  finish_reason: str  # "stop" or "length"
  hidden: np.ndarray | None = None  # [n, H] when the engine captures hidden states
  prompt_hidden: np.ndarray | None = None  # [P, H] the prompt's features (its last one is hidden[0])


@dataclasses.dataclass
class SegmentRecord:
  """One play of the decode loop between host syncs: a fused plain or speculative segment."""

  bucket: int
  active_rows: int
  tokens: int
  seconds: float
  strategy: str | None = None  # None: plain decoding
  passes: int = 0  # row-steps: target forward passes summed over active rows
  steps: int = 1  # decode steps (target forward passes of the batch)
  tail: bool = False  # speculation was an option (the arm was chosen, SD off included)
  waiting: int = 0  # rows of the rollout not yet in the batch when the play began


@dataclasses.dataclass
class RolloutMetrics:
  prefill_s: float = 0.0
  decode_s: float = 0.0
  compact_s: float = 0.0
  tokens: int = 0
  segments: list[SegmentRecord] = dataclasses.field(default_factory=list)
  drafter_nonfinite: bool = False  # the drafter's outputs were NaN/inf: speculation was turned off
  refills: int = 0  # times waiting rows were prefilled into finished rows' slots
  started: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (prompt, sample) in batch-entry order

  @property
  def wall_s(self) -> float:
    return self.prefill_s + self.decode_s + self.compact_s

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / max(self.wall_s, 1e-9)

  def buckets(self) -> list[int]:
    return [s.bucket for s in self.segments]

  def occupancy(self) -> list[float]:
    """Active rows per play, averaged over its decode steps (row-steps / steps)."""
    return [s.passes / max(s.steps, 1) for s in self.segments]

  @property
  def idle_slot_fraction(self) -> float:
    """Share of the batch's slot-steps spent on no row (finished rows dragged along, empty slots)."""
    slot_steps = sum(s.steps * s.bucket for s in self.segments)
    return 1 - sum(s.passes for s in self.segments) / max(slot_steps, 1)

  @property
  def tail_share(self) -> float:
    """Share of decode time in plays that began with at most half the largest bucket's rows active."""
    half = max(self.buckets(), default=0) / 2
    return sum(s.seconds for s in self.segments if s.active_rows <= half) / max(self.decode_s, 1e-9)

  @property
  def sd_s(self) -> float:
    return sum(s.seconds for s in self.segments if s.strategy)

  @property
  def verify_passes(self) -> int:
    return sum(s.passes for s in self.segments if s.strategy)

  @property
  def accept_len(self) -> float:
    """Mean tokens emitted per speculative verify pass (bonus included); 0 without speculation."""
    return sum(s.tokens for s in self.segments if s.strategy) / max(self.verify_passes, 1)

  def summary(self) -> dict[str, float | int]:
    """Flat metrics record: times, tokens/s, acceptance, SD share, steps per batch bucket, and
    how often each arm ("off" or a strategy) was played in the tail per batch bucket."""
    out = {"rollout/tokens": self.tokens, "rollout/tokens_per_s": self.tokens_per_s, "rollout/wall_s": self.wall_s,
           "rollout/prefill_s": self.prefill_s, "rollout/decode_s": self.decode_s, "rollout/compact_s": self.compact_s,
           "rollout/sd_s": self.sd_s, "rollout/plain_s": self.decode_s - self.sd_s,
           "rollout/sd_share": self.sd_s / max(self.wall_s, 1e-9), "rollout/accept_len": self.accept_len,
           "rollout/verify_passes": self.verify_passes, "rollout/drafter_nonfinite": int(self.drafter_nonfinite),
           "rollout/refills": self.refills, "rollout/tail_share": self.tail_share,
           "rollout/idle_slot_fraction": self.idle_slot_fraction}
    for s in self.segments:
      key = f"rollout/steps/b{s.bucket}"
      out[key] = out.get(key, 0) + s.steps
      if s.tail:
        key = f"bandit/b{s.bucket}/arm_{s.strategy or 'off'}"
        out[key] = out.get(key, 0) + 1
    return out


@dataclasses.dataclass
class Rollout:
  samples: list[Sample]  # ordered by (prompt_index, sample_index)
  metrics: RolloutMetrics


def _where_rows(mask_B, new, old):
  return jnp.where(mask_B.reshape(mask_B.shape + (1,) * (new.ndim - 1)), new, old)


def _per_row(st: RowState) -> RowState:
  """The fields with one entry per row (caches and the bank, held per prompt, left out)."""
  return dataclasses.replace(st, cache=None, drafter_cache=None, bank=None)


class Engine:
  """Generates from a `CausalLM` with sampling params fixed per engine (they are compiled in).

  With a `drafter` and `config.strategies`, rows of the tail (at most `config.sd_max_batch`
  active) decode speculatively, with the one strategy or the one a `bandit` picks per segment
  (it may pick plain decoding); the output distribution is the target's either way.
  """

  def __init__(self, model: transformer.CausalLM, config: EngineConfig, params: SamplingParams,
               mesh: jax.sharding.Mesh | None = None, drafter: Drafter | None = None, bandit: Bandit | None = None):
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
    if config.compilation_cache_dir and jax.config.jax_compilation_cache_dir != config.compilation_cache_dir:
      jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
      compilation_cache.reset_cache()  # JAX opens the cache once per process: make it open the new dir
    self.model_config = model.config
    self.graphdef, self.params = nnx.split(model)
    self.drafter_graphdef, self.drafter_params = nnx.split(drafter) if drafter is not None else (None, None)
    self.pool = ExecutablePool()
    self._dtype = model.model.embed_tokens.embedding.dtype

  def set_params(self, state: nnx.State) -> None:
    """Swaps in new weights of the same shapes (e.g. after an RL update); no recompilation."""
    self.params = state

  def set_drafter_params(self, state: nnx.State) -> None:
    self.drafter_params = state

  # ---- pure functions (compiled per shape) ----

  def _models(self, params, drafter_params):
    model = nnx.merge(self.graphdef, params)
    drafter = None if self.drafter_graphdef is None else nnx.merge(self.drafter_graphdef, drafter_params)
    return model, drafter

  def _init(self, prompt_index, sample_index, row_id, max_new, bank_row, bank_offset, bank_room):
    cfg, mc = self.config, self.model_config
    b, n = prompt_index.shape[0], self.sampling.max_new_tokens
    zeros = jnp.zeros((b,), jnp.int32)
    drafting = self.drafter_graphdef is not None
    banking = cfg.banking
    return RowState(
        cache=KVCache.zeros(mc, b, cfg.capacity, self._dtype), last_token=zeros, num_generated=zeros,
        max_new=max_new, done=row_id < 0, finish=zeros, prompt_index=prompt_index,
        sample_index=sample_index, row_id=row_id, tokens=jnp.zeros((b, n), jnp.int32),
        logprobs=jnp.zeros((b, n), jnp.float32),
        hidden=jnp.zeros((b, n, mc.hidden_size), self._dtype) if cfg.capture_hidden else None, passes=zeros,
        prompt_hidden=jnp.zeros((b, cfg.max_prompt_len, mc.hidden_size), self._dtype) if cfg.capture_hidden else None,
        drafter_cache=KVCache.zeros(mc, b, cfg.capacity, self._dtype, num_layers=1) if drafting else None,
        draft_feat=jnp.zeros((b, mc.hidden_size), self._dtype) if drafting else None,
        drafter_finite=jnp.ones((b,), bool) if drafting else None,
        bank=jnp.full((cfg.bank_rows, cfg.suffix_bank_len), -1, jnp.int32) if banking else None,
        bank_row=bank_row if banking else None, bank_offset=bank_offset if banking else None,
        bank_room=bank_room if banking else None)

  def _reset(self, st: RowState, prompt_index, sample_index, row_id, max_new, bank_row, bank_offset, bank_room,
             clear_bank):
    """Empties the slots with `row_id >= 0` for those new rows (identity, budget, bank place; counters
    and outputs as `init` makes them), ready for `prefill`; other slots are unchanged, and so are
    the bank rows but the new prompts' (`clear_bank`). The caches are left as they are: the prefill
    writes a new row's prompt slots and lengths, and nothing reads past them."""
    fresh = self._init(prompt_index, sample_index, row_id, max_new, bank_row, bank_offset, bank_room)
    out = jax.tree.map(functools.partial(_where_rows, row_id >= 0), _per_row(fresh), _per_row(st))
    bank = None if st.bank is None else jnp.where(clear_bank[:, None], -1, st.bank)
    return dataclasses.replace(out, cache=st.cache, drafter_cache=st.drafter_cache, bank=bank)

  def _record(self, st: RowState, active, acc: speculative.Accepted, hidden_BxMxH):
    """Writes the accepted tokens (and the features that produced them) into the row outputs."""
    b, m = acc.tokens.shape
    rows = jnp.arange(b)[:, None]
    j = jnp.arange(m)[None]
    pos = jnp.where(j < acc.count[:, None], st.num_generated[:, None] + j, st.tokens.shape[1])  # else dropped
    last = acc.tokens[rows[:, 0], jnp.maximum(acc.count - 1, 0)]
    hidden = st.hidden
    if hidden is not None:
      hidden = hidden.at[rows, pos].set(hidden_BxMxH.astype(hidden.dtype), mode="drop")
    bank = st.bank
    if bank is not None:  # the first `bank_room` tokens of the row also go to its region of the bank
      keep = (j < acc.count[:, None]) & (st.num_generated[:, None] + j < st.bank_room[:, None])
      at = jnp.where(keep, st.bank_offset[:, None] + st.num_generated[:, None] + j, bank.shape[1])
      bank = bank.at[st.bank_row[:, None], at].set(acc.tokens, mode="drop")
    return dataclasses.replace(
        st, bank=bank, last_token=jnp.where(acc.count > 0, last, st.last_token),
        num_generated=st.num_generated + acc.count,
        done=st.done | acc.stop | acc.length, finish=jnp.where(acc.stop, 1, jnp.where(acc.length, 2, st.finish)),
        tokens=st.tokens.at[rows, pos].set(acc.tokens, mode="drop"),
        logprobs=st.logprobs.at[rows, pos].set(acc.logprobs, mode="drop"), hidden=hidden,
        passes=st.passes + active)

  def _drafter_pass(self, model, drafter, dcache: KVCache, features_BxMxH, tokens_BxM, kv_block):
    """The drafter over pairs (f_p, x_{p+1}) at positions `dcache.lengths + j`: its outputs [B, M, H]
    and the cache with their keys/values written (lengths not advanced)."""
    b, m = tokens_BxM.shape
    positions = dcache.lengths[:, None] + jnp.arange(m)[None]
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((m, m), bool)), (b, m, m))
    return drafter(model, features_BxMxH, tokens_BxM, positions, dcache, causal, kv_block=kv_block,
                   attention=self.config.attention)

  def _feed_drafter(self, model, drafter, st: RowState, pairs: Pairs, kv_block) -> RowState:
    """Writes the committed pairs (f_p, x_{p+1}) into the drafter cache; keeps the last output."""
    out, dcache = self._drafter_pass(model, drafter, st.drafter_cache, pairs.features, pairs.tokens, kv_block)
    count_B = pairs.count
    last = out[jnp.arange(count_B.shape[0]), jnp.maximum(count_B - 1, 0)]
    finite = jnp.isfinite(last).all(-1) | (count_B == 0)
    return dataclasses.replace(st, drafter_cache=dataclasses.replace(dcache, lengths=dcache.lengths + count_B),
                               draft_feat=jnp.where((count_B > 0)[:, None], last, st.draft_feat),
                               drafter_finite=st.drafter_finite & finite)

  def _prefill(self, params, drafter_params, st: RowState, tokens_PxT, lengths_P, row_prompt_B):
    """Prefills P unique prompts and copies each into its rows (row_prompt_B >= 0)."""
    model, drafter = self._models(params, drafter_params)
    p, t = tokens_PxT.shape
    layers = drafter.feature_layers if drafter is not None else ()
    out = transformer.prefill(model, tokens_PxT, lengths_P, KVCache.zeros(self.model_config, p, t, self._dtype),
                              hidden_layers=layers)
    sel, src = row_prompt_B >= 0, jnp.maximum(row_prompt_B, 0)
    copy_rows = lambda new, old: jnp.moveaxis(_where_rows(sel, jnp.moveaxis(new, 1, 0), jnp.moveaxis(old, 1, 0)), 0, 1)
    cache = KVCache(k=st.cache.k.at[:, :, :t].set(copy_rows(out.cache.k[:, src], st.cache.k[:, :, :t])),
                    v=st.cache.v.at[:, :, :t].set(copy_rows(out.cache.v[:, src], st.cache.v[:, :, :t])),
                    lengths=jnp.where(sel, lengths_P[src], st.cache.lengths))
    rows = jnp.arange(src.shape[0])
    last = jnp.maximum(lengths_P[src] - 1, 0)
    if st.bank is not None:  # the prompt, right-aligned to max_prompt_len (every row of it writes the same)
      j = jnp.arange(t)[None]
      at = self.config.max_prompt_len - lengths_P[src][:, None] + j
      at = jnp.where(sel[:, None] & (j < lengths_P[src][:, None]), at, st.bank.shape[1])
      st = dataclasses.replace(st, bank=st.bank.at[st.bank_row[:, None], at].set(tokens_PxT[src], mode="drop"))
    if st.prompt_hidden is not None:
      old = st.prompt_hidden[:, :t]
      st = dataclasses.replace(st, prompt_hidden=st.prompt_hidden.at[:, :t].set(
          _where_rows(sel, out.hidden[src].astype(old.dtype), old)))
    acc = speculative.accept(out.logits[src][:, None], speculative.root_only(st.last_token), sel, st.num_generated,
                             st.max_new, st.prompt_index, st.sample_index, self.sampling, 0)
    st = self._record(dataclasses.replace(st, cache=cache), jnp.zeros_like(sel), acc,
                      out.hidden[src][rows, last][:, None])
    if drafter is None:
      return st
    # The drafter's prompt pairs (f_p, x_{p+1}), p < length - 1, are the same for every sample of a
    # prompt: they run once per unique prompt and are copied into its rows, like the target's cache.
    # The last pair holds the row's own first token, so it is fed per row.
    features = drafter.target_features(out.hidden, out.aux_hidden)
    shifted = jnp.concatenate([tokens_PxT[:, 1:], jnp.zeros((p, 1), jnp.int32)], axis=1)
    _, shared = self._drafter_pass(model, drafter, drafter.empty_cache(p, t, self._dtype), features, shifted, None)
    dcache = st.drafter_cache
    dcache = KVCache(k=dcache.k.at[:, :, :t].set(copy_rows(shared.k[:, src], dcache.k[:, :, :t])),
                     v=dcache.v.at[:, :, :t].set(copy_rows(shared.v[:, src], dcache.v[:, :, :t])),
                     lengths=jnp.where(sel, last, dcache.lengths))
    first = Pairs(features[src][rows, last][:, None], acc.tokens[:, :1], sel.astype(jnp.int32))
    return self._feed_drafter(model, drafter, dataclasses.replace(st, drafter_cache=dcache), first, None)

  def _verify_step(self, model, drafter, st: RowState, tree: speculative.Tree, depth: int):
    """Verifies `tree` (paths at most `depth` below the root) for every active row and commits the
    accepted path; with the one-node tree this is a plain step. Returns the state and, with a
    drafter, the committed pairs for it."""
    active = ~st.done
    layers = drafter.feature_layers if drafter is not None else ()
    out = transformer.verify(model, tree.tokens, st.cache.lengths[:, None] + tree.depths, tree.mask, st.cache,
                             kv_block=self.config.kv_block, attention=self.config.attention, hidden_layers=layers)
    acc = speculative.accept(out.logits, tree, active, st.num_generated, st.max_new, st.prompt_index,
                             st.sample_index, self.sampling, depth)
    if depth:
      cache = speculative.commit(out.cache, acc.nodes, acc.count)
    else:  # a one-node tree: the accepted token's keys/values are already at the row's length
      cache = dataclasses.replace(out.cache, lengths=out.cache.lengths + acc.count)
    rows = jnp.arange(acc.nodes.shape[0])[:, None]
    st = self._record(dataclasses.replace(st, cache=cache), active, acc, out.hidden[rows, acc.nodes])
    if drafter is None:
      return st, None
    return st, Pairs(drafter.target_features(out.hidden, out.aux_hidden)[rows, acc.nodes], acc.tokens, acc.count)

  def _segment(self, params, drafter_params, st: RowState, stop_at, strategy: Strategy | None):
    """One play: up to `segment_steps` iterations of plain decoding (`strategy` None) or of
    draft -> verify -> accept -> commit -> drafter feed, in one `lax.while_loop` on the device.

    The loop runs at least once and ends early once at most `stop_at` rows are active (every row
    done, a smaller batch bucket fits the rest, or the tail begins), or, speculating, once a
    drafter output is not finite (the host then turns speculation off). A plain segment collects
    its committed pairs and feeds them to the drafter in ONE call at the end (a chunk of up to
    `segment_steps` positions, like a prefill), so the drafter cache is current at every play
    boundary, ready for the bandit to switch speculation on.
    """
    model, drafter = self._models(params, drafter_params)
    n, b = self.config.segment_steps, st.last_token.shape[0]
    kv_block = self.config.kv_block
    rows = jnp.arange(b)

    def running(i, st):
      go = (i < n) & ((i == 0) | (jnp.sum(~st.done) > stop_at))
      return go if strategy is None or drafter is None else go & jnp.all(st.drafter_finite)

    if strategy is not None:
      if strategy.suffix:
        def draft(st):
          bank_BxL = st.bank[st.bank_row]
          context = suffix.context(bank_BxL, st.tokens, st.num_generated, self.config.max_prompt_len,
                                   self.config.suffix_ngram)
          return suffix.draft_tree(bank_BxL, context, st.last_token, strategy), st
      else:
        head = drafter.head(model)  # gathered once per play, outside the loop

        def draft_fn(cache, feats, tokens, positions, mask):
          return drafter(model, feats, tokens, positions, cache, mask, kv_block=kv_block,
                         attention=self.config.attention)

        def draft(st):
          tree, dcache = speculative.draft_tree(draft_fn, lambda f: drafter.logits(model, head, f), st.draft_feat,
                                                st.last_token, st.drafter_cache, strategy, drafter.target_ids)
          return tree, dataclasses.replace(st, drafter_cache=dcache)

      def speculate(carry):
        i, st = carry
        tree, st = draft(st)
        st, pairs = self._verify_step(model, drafter, st, tree, strategy.depth)
        # Suffix drafts too feed a drafter its committed pairs: an EAGLE arm may play next.
        return i + 1, st if drafter is None else self._feed_drafter(model, drafter, st, pairs, kv_block)

      return jax.lax.while_loop(lambda c: running(*c), speculate, (jnp.int32(0), st))[1]

    def step(carry):
      i, st, pairs = carry
      st, new = self._verify_step(model, drafter, st, speculative.root_only(st.last_token), 0)
      if pairs is not None:  # append each row's committed pair (0 or 1 of them) at its own count
        at = jnp.where(new.count > 0, pairs.count, n)  # n: dropped
        pairs = Pairs(pairs.features.at[rows, at].set(new.features[:, 0].astype(pairs.features.dtype), mode="drop"),
                      pairs.tokens.at[rows, at].set(new.tokens[:, 0], mode="drop"), pairs.count + new.count)
      return i + 1, st, pairs

    pairs = None
    if drafter is not None:
      pairs = Pairs(jnp.zeros((b, n, st.draft_feat.shape[-1]), self._dtype), jnp.zeros((b, n), jnp.int32),
                    jnp.zeros((b,), jnp.int32))
    _, st, pairs = jax.lax.while_loop(lambda c: running(c[0], c[1]), step, (jnp.int32(0), st, pairs))
    return st if pairs is None else self._feed_drafter(model, drafter, st, pairs, kv_block)

  @staticmethod
  def _halve(st: RowState, keep_b):
    """Gathers rows `keep_b` (half the bucket; -1 = empty slot) into a state half the size."""
    src = jnp.maximum(keep_b, 0)
    out = jax.tree.map(lambda x: x[src], _per_row(st))
    take_cache = lambda c: None if c is None else KVCache(k=c.k[:, src], v=c.v[:, src], lengths=c.lengths[src])
    empty = keep_b < 0
    # The bank stays: it is held per prompt, and rows keep their bank row through the gather.
    return dataclasses.replace(out, cache=take_cache(st.cache), drafter_cache=take_cache(st.drafter_cache),
                               bank=st.bank, done=out.done | empty, row_id=jnp.where(empty, -1, out.row_id))

  # ---- the executable pool ----

  def _abstract_state(self, b: int) -> RowState:
    """The state of bucket `b`, shaped and (on a mesh) sharded as `init` makes it."""
    i32 = jax.ShapeDtypeStruct((b,), jnp.int32)
    state = jax.eval_shape(self._init, *[i32] * 7)
    if self.mesh is None:
      return state
    # On a mesh the executables take the state with the shardings `init` gives it.
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                        self._shardings(state))

  def _abstract_tree(self, b: int, verify_tokens: int) -> speculative.Tree:
    i32 = jax.ShapeDtypeStruct((b, verify_tokens), jnp.int32)
    return speculative.Tree(i32, i32, i32, jax.ShapeDtypeStruct((b, verify_tokens, verify_tokens), jnp.bool_))

  def _shardings(self, out):
    """Rows split over the mesh's batch axis: row states (caches by the cache rules), trees, tuples."""
    if self.mesh is None:
      return None
    if isinstance(out, tuple):
      return tuple(self._shardings(o) for o in out)
    batch = lambda x: sharding.array_sharding(x.shape, ("batch",) + (None,) * (x.ndim - 1), self.mesh)
    if not isinstance(out, RowState):
      return jax.tree.map(batch, out)
    shardings = jax.tree.map(batch, _per_row(out))
    cache = lambda c: None if c is None else sharding.cache_shardings(c, self.mesh)
    bank = None if out.bank is None else sharding.array_sharding(out.bank.shape, (None, None), self.mesh)  # replicated
    return dataclasses.replace(shardings, cache=cache(out.cache), drafter_cache=cache(out.drafter_cache), bank=bank)

  def _compile(self, key, fn, args, out, donate=()):
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
    cfg = self.config
    return bool(cfg.strategies) and bucket <= cfg.bucket(min(cfg.sd_max_batch, cfg.batch_buckets[-1]))

  def prepare(self, rows: int, prompt_lens: Sequence[int] = ()) -> None:
    """Compiles everything a rollout of `rows` rows needs (no-op for what the pool holds): with more
    rows than the largest bucket, the slot reset of refill, or the smaller last wave's executables."""
    cfg = self.config
    largest = cfg.batch_buckets[-1]
    if rows > largest and not cfg.refill and rows % largest:
      self.prepare(rows % largest, prompt_lens)
    b0 = cfg.bucket(min(rows, largest))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    params = (self.params, self.drafter_params)
    state = self._abstract_state
    self._compile(("init", b0), self._init, [i32(b0)] * 7, state(b0))
    if rows > largest and cfg.refill:
      self._compile(("reset", b0), self._reset,
                    [state(b0), *[i32(b0)] * 7, jax.ShapeDtypeStruct((cfg.bank_rows,), jnp.bool_)], state(b0),
                    donate=(0,))
    for p in self._prefill_sizes(b0):
      for t in sorted({self._prompt_bucket(n) for n in prompt_lens} or set(cfg.prompt_buckets)):
        self._compile(("prefill", b0, p, t), self._prefill, [*params, state(b0), i32(p, t), i32(p), i32(b0)],
                      state(b0), donate=(2,))
    for b in cfg.batch_buckets:
      if b > b0 or (b < b0 and not cfg.compact):  # without compaction only b0 runs
        continue
      for s in (None, *(cfg.strategies if self._uses_sd(b) else ())):
        self._compile(self._segment_key(b, s), functools.partial(self._segment, strategy=s),
                      [*params, state(b), i32()], state(b), donate=(2,))
      if b > 1 and cfg.compact:
        self._compile(("halve", b // 2, b), self._halve, [state(b), i32(b // 2)], state(b // 2))

  def _prefill_sizes(self, bucket: int) -> tuple[int, ...]:
    """Unique prompts per prefill call at `bucket`: up to `prefill_batch`; at the largest bucket of
    a refilling engine also the (power of two) size of a refill chunk, so bringing in a few rows
    does not prefill a full call's padding. The same for every rollout: what one prepared, all use."""
    cfg = self.config
    full = min(cfg.prefill_batch, bucket)
    if not cfg.refill or bucket < cfg.batch_buckets[-1]:
      return (full,)
    return tuple(sorted({min(full, 1 << (cfg.refill_chunk - 1).bit_length()), full}))

  @staticmethod
  def _segment_key(bucket: int, strategy: Strategy | None) -> tuple:
    return ("plain", bucket) if strategy is None else ("speculate", bucket, strategy.name)

  def _prompt_bucket(self, n: int) -> int:
    return next(t for t in self.config.prompt_buckets if t >= n)

  # ---- the host loop ----

  def generate(self, prompts: Sequence[Sequence[int]], num_samples: int = 1,
               max_total_len: Sequence[int] | int | None = None,
               on_progress: Callable[[int, int], None] | None = None, prompt_offset: int = 0,
               expected_lengths: Sequence[float] | None = None) -> Rollout:
    """Samples `num_samples` continuations of each prompt (token ids).

    `on_progress(rows_finished_delta, tokens_delta)` is called at every segment boundary.
    `prompt_offset`: the prompts are a shard starting at this index of a larger batch (data-parallel
    rollout); RNG keys and `Sample.prompt_index` use the global index, so a sharded rollout
    samples exactly what one engine would.
    `expected_lengths`: per prompt, e.g. its mean response length in an earlier epoch; rows enter the
    batch longest expected first (ties in order) instead of in order, so the longest rows do not
    start last and stretch the tail. Order changes when a row runs, never its tokens.
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
    self.prepare(len(rows), [len(p) for p in prompts])
    largest = cfg.batch_buckets[-1]
    batches = [rows] if cfg.refill else [rows[s:s + largest] for s in range(0, len(rows), largest)]
    metrics = RolloutMetrics()
    samples = []
    for batch in batches:
      samples += self._run(prompts, batch, budgets, metrics, on_progress or (lambda rows, tokens: None),
                           prompt_offset)
    samples.sort(key=lambda s: (s.prompt_index, s.sample_index))
    return Rollout(samples, metrics)

  def _bank_rows(self, rows) -> suffix.BankRows | None:
    """The bank's host bookkeeping for (prompt, sample) `rows`; None without suffix strategies."""
    cfg = self.config
    if not cfg.banking:
      return None
    layout = suffix.Layout(cfg.suffix_bank_len, cfg.max_prompt_len, 1 + max(j for _, j in rows),
                           self.sampling.max_new_tokens)
    return suffix.BankRows(layout, cfg.bank_rows, collections.Counter(i for i, _ in rows))

  def _identity(self, rows, slot_row: np.ndarray, budgets, prompt_offset,
                bank: suffix.BankRows | None) -> list[np.ndarray]:
    """`init` arguments: prompt, sample, row id, budget and bank place (row, offset, room) of the row in
    each slot (-1: none); `reset` takes them and the bank rows to empty."""
    pick = lambda f, empty: np.asarray([f(r) if r >= 0 else empty for r in slot_row], np.int32)
    places = [bank.place(*rows[r]) if bank is not None and r >= 0 else (0, 0, 0) for r in slot_row]
    return [pick(lambda r: prompt_offset + rows[r][0], 0), pick(lambda r: rows[r][1], 0), pick(lambda r: r, -1),
            pick(lambda r: budgets[rows[r][0]], 1), *np.asarray(places, np.int32).reshape(-1, 3).T]

  def _prefill_slots(self, st: RowState, prompts, rows, slot_row: np.ndarray) -> RowState:
    """Prefills the rows of the slots `slot_row >= 0`: each unique prompt once per call of up to
    `prefill_batch` prompts (the smallest compiled size that holds them), copied into its rows' slots."""
    b = slot_row.shape[0]
    sizes = self._prefill_sizes(b)
    unique = sorted({rows[r][0] for r in slot_row if r >= 0})
    c = 0
    while c < len(unique):
      p = next((n for n in sizes if n >= len(unique) - c), sizes[-1])
      chunk = unique[c:c + p]
      c += p
      t = self._prompt_bucket(max(len(prompts[i]) for i in chunk))
      tokens = np.zeros((p, t), np.int32)
      lengths = np.zeros((p,), np.int32)
      for k, i in enumerate(chunk):
        tokens[k, :len(prompts[i])] = prompts[i]
        lengths[k] = len(prompts[i])
      slot = {i: k for k, i in enumerate(chunk)}
      row_prompt = np.asarray([slot.get(rows[r][0], -1) if r >= 0 else -1 for r in slot_row], np.int32)
      st = self.pool[("prefill", b, p, t)](self.params, self.drafter_params, st, tokens, lengths, row_prompt)
    return st

  def _run(self, prompts, rows, budgets, metrics, on_progress, prompt_offset) -> list[Sample]:
    """Decodes (prompt index, sample index) `rows`, in this order of entry, until every one is done.

    The batch takes the first rows that fit the largest bucket. While rows wait, it stays at that
    bucket: once `refill_chunk` of its slots are free (or every waiting row fits) the play ends on
    the device, the finished rows are harvested and waiting rows are prefilled into their slots.
    Each refill pays one sync and a fixed-shape prefill whatever the rows it brings, so waiting
    for a chunk amortises it while keeping the batch at least 3/4 full (default chunk: a quarter).
    Once nothing waits, the tail compacts into smaller buckets and may speculate.
    """
    cfg, pool = self.config, self.pool
    b = cfg.bucket(min(len(rows), cfg.batch_buckets[-1]))
    t0 = time.perf_counter()
    bank = self._bank_rows(rows)
    queued = min(b, len(rows))  # rows[queued:] wait
    first = np.asarray(list(range(queued)) + [-1] * (b - queued), np.int32)
    st = pool[("init", b)](*self._identity(rows, first, budgets, prompt_offset, bank))
    if bank is not None:
      bank.take_fresh()  # init's bank is empty: only later prompts' rows need emptying
    st = self._prefill_slots(st, prompts, rows, first)
    # Host copies of the per-row counters, refreshed by every play's sync.
    done, generated, passes = jax.device_get((st.done, st.num_generated, st.passes))
    self._check_drafter(st, metrics)
    metrics.prefill_s += time.perf_counter() - t0
    metrics.tokens += queued
    metrics.started += rows[:queued]
    on_progress(int(done[:queued].sum()), queued)
    out: list[Sample] = []
    harvested = np.zeros((len(rows),), bool)
    prompt_lens = [len(prompts[i]) for i, _ in rows]

    def harvest(st):
      samples = self._harvest(st, harvested, prompt_lens)
      for s in samples if bank is not None else ():  # their bank rows are free once a prompt's rows are all in
        bank.harvested(s.prompt_index - prompt_offset)
      return samples

    while queued < len(rows) or not done.all():
      active = int((~done).sum())
      waiting = len(rows) - queued
      if waiting and b - active >= min(cfg.refill_chunk, waiting):
        t0 = time.perf_counter()
        out += harvest(st)
        free = np.flatnonzero(done)[:waiting]
        new = np.full((b,), -1, np.int32)
        new[free] = np.arange(queued, queued + len(free))
        identity = self._identity(rows, new, budgets, prompt_offset, bank)
        st = pool[("reset", b)](st, *identity, np.zeros((0,), bool) if bank is None else bank.take_fresh())
        st = self._prefill_slots(st, prompts, rows, new)
        done, generated, passes = jax.device_get((st.done, st.num_generated, st.passes))
        self._check_drafter(st, metrics)
        metrics.prefill_s += time.perf_counter() - t0
        metrics.tokens += len(free)
        metrics.refills += 1
        metrics.started += rows[queued:queued + len(free)]
        queued += len(free)
        on_progress(int(done[free].sum()), len(free))
        continue
      if not waiting and cfg.compact and cfg.bucket(active) < b:
        t0 = time.perf_counter()
        out += harvest(st)
        while cfg.bucket(active) < b:
          keep = np.flatnonzero(~done)
          keep = np.concatenate([keep, np.full((b // 2 - len(keep),), -1)]).astype(np.int32)
          st = pool[("halve", b // 2, b)](st, keep)
          done = np.concatenate([done[keep[keep >= 0]], np.ones((b // 2 - (keep >= 0).sum(),), bool)])
          b //= 2
        done, generated, passes = jax.device_get((st.done, st.num_generated, st.passes))
        metrics.compact_s += time.perf_counter() - t0
      speculating = self._uses_sd(b) and not metrics.drafter_nonfinite
      tail = speculating and active <= cfg.sd_max_batch
      strategy = None
      if tail:
        strategy = cfg.strategies[0] if self.bandit is None else self.bandit.choose(active)
      # The play ends on the device once enough slots are free for a refill, or, with nothing
      # waiting, once a smaller bucket fits the active rows (compaction); before the tail, once the
      # tail begins (the bandit's turn).
      stop_at = b - min(cfg.refill_chunk, waiting) if waiting else (b // 2 if cfg.compact else 0)
      if speculating and not tail:
        stop_at = max(stop_at, cfg.sd_max_batch)
      t0 = time.perf_counter()
      st = pool[self._segment_key(b, strategy)](self.params, self.drafter_params, st, np.int32(stop_at))
      before = generated, passes
      done, generated, passes = jax.device_get((st.done, st.num_generated, st.passes))  # waits for the play
      seconds = time.perf_counter() - t0
      self._check_drafter(st, metrics)
      produced = int(generated.sum() - before[0].sum())
      metrics.decode_s += seconds
      metrics.tokens += produced
      metrics.segments.append(SegmentRecord(b, active, produced, seconds, strategy and strategy.name,
                                            int(passes.sum() - before[1].sum()), int((passes - before[1]).max()), tail,
                                            waiting))
      if self.bandit is not None and tail:
        self.bandit.update(active, strategy, produced, seconds)
      on_progress(active - int((~done).sum()), produced)
    return out + harvest(st)

  def _check_drafter(self, st: RowState, metrics: RolloutMetrics) -> None:
    """Turns speculation off for the rest of the rollout once the drafter's outputs are not finite."""
    if st.drafter_finite is None or metrics.drafter_nonfinite:
      return
    finite = np.asarray(jax.device_get(st.drafter_finite))
    if not finite.all():
      metrics.drafter_nonfinite = True
      logging.warning("the drafter's outputs are not finite (NaN/inf) for %d of %d rows: speculation is off for the "
                      "rest of this rollout (outputs are unaffected)", int((~finite).sum()), finite.size)

  def _harvest(self, st: RowState, harvested: np.ndarray, prompt_lens: Sequence[int]) -> list[Sample]:
    """Host copies of the finished rows not yet taken (before compaction drops them)."""
    host = jax.device_get(dataclasses.replace(_per_row(st), draft_feat=None))
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
