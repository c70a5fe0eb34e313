"""The rollout engine's pure functions over `RowState`, compiled ahead of time for every batch bucket.

`Steps` holds what they close over (the models' graph definitions, the engine config, the
sampling params); params and state are arguments. `init` makes a batch's state, `prefill` brings
in a chunk of unique prompts (copied into each of their sample rows: GRPO groups share one
prefill), `segment` is one play (a `lax.while_loop` of up to `segment_steps` iterations: plain
decoding steps, or speculative iterations of one strategy), `halve` compacts the rows into the
next smaller bucket and `reset` empties chosen slots for new rows. A segment ends on the device
once at most `stop_at` rows are active, the point the host chose (a refill, a smaller bucket,
the tail).

One verify function serves plain and speculative decoding: a plain step verifies the one-node
tree (the last token), a speculative iteration drafts an EAGLE-2 tree, verifies it, accepts with
`speculative.accept`, commits the accepted path's keys/values and feeds the committed (feature,
token) pairs to the drafter, all inside the loop: the host never drives a speculative step. A
plain segment feeds the drafter once at its end (one chunked pass), so the drafter cache is
current whenever the tail switches speculation on.

Suffix strategies draft without a model (`tlt_jax.rollout.suffix`) from the row's prompt's bank
row; their trees go through the same verify step, and with a drafter its feed goes on, so an
EAGLE arm can play next. Every drafter feed records whether its outputs stayed finite
(`RowState.drafter_finite`); a speculative segment stops once one is not.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from tlt_jax.drafter.model import Drafter
from tlt_jax.kernels import layout
from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import KVCache
from tlt_jax.rollout import speculative, suffix
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.speculative import Strategy
from tlt_jax.rollout.state import EngineConfig, CommittedPairs, RowState, SlotRows, Verified


@flax.struct.dataclass
class _Carry:
  """A segment's loop state: iterations run, the rows, and a plain segment's pairs for the drafter."""

  step: jax.Array
  state: RowState
  pairs: CommittedPairs | None = None


def _where_rows(mask_B, new, old):
  return jnp.where(mask_B.reshape(mask_B.shape + (1,) * (new.ndim - 1)), new, old)


def record(st: RowState, active_B, acc: speculative.Accepted, hidden_BxMxH) -> RowState:
  """Writes the accepted tokens (M at most per row; `acc.count` of them), their log-probs and the
  features that produced them into the row outputs and the bank; counts a pass for `active_B` rows."""
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
      passes=st.passes + active_B)


def with_pages(st: RowState, pages_BxM) -> RowState:
  """The state with the host's page tables (None: a contiguous cache, unchanged)."""
  if pages_BxM is None:
    return st
  dcache = st.drafter_cache
  return dataclasses.replace(st, cache=dataclasses.replace(st.cache, pages=pages_BxM),
                             drafter_cache=None if dcache is None else dataclasses.replace(dcache, pages=pages_BxM))


def drop(st: RowState, drop_B) -> RowState:
  """Empties the slots `drop_B` (bool [B]) without harvesting them: preempted rows, resumed later."""
  return dataclasses.replace(st, done=st.done | drop_B, row_id=jnp.where(drop_B, -1, st.row_id))


def take_rows(x_LxBxPxKxD, keep_b):
  """x[:, keep_b] (-1: an empty slot, row 0's), a contiguous cache array's rows for `halve`, gathered over a
  [L, B, P, K * D] view: over the 5-d array XLA:CPU gathered into a transposed layout and copied it out, a
  half cache of scratch."""
  l, b, p, k, d = x_LxBxPxKxD.shape
  return x_LxBxPxKxD.reshape(l, b, p, k * d)[:, jnp.maximum(keep_b, 0)].reshape(l, len(keep_b), p, k, d)


def halve(st: RowState, keep_b) -> RowState:
  """Compaction: the rows of slots `keep_b` (int32 [B/2], -1: an empty slot) gathered into a state
  of half the batch, B/2; the bank stays as it is (it is held per prompt), and so does a paged
  cache's pool (only the page tables move). A contiguous target cache may come without its values
  (None: `Engine` gathers them apart with `take_rows`, after the old keys are freed)."""
  src = jnp.maximum(keep_b, 0)
  out = jax.tree.map(lambda x: x[src], st.per_row())

  def take_cache(c):
    if c is None:
      return None
    if c.pages is not None:
      return dataclasses.replace(c, lengths=c.lengths[src], pages=c.pages[src])
    return KVCache(k=take_rows(c.k, keep_b), v=None if c.v is None else take_rows(c.v, keep_b),
                   lengths=c.lengths[src])

  empty = keep_b < 0
  # Rows keep their bank row through the gather.
  return dataclasses.replace(out, cache=take_cache(st.cache), drafter_cache=take_cache(st.drafter_cache),
                             bank=st.bank, done=out.done | empty, row_id=jnp.where(empty, -1, out.row_id))


@dataclasses.dataclass(frozen=True, eq=False)
class Steps:
  """The step functions of one engine: for its target (and drafter) architecture, config and sampling.

  Attributes:
    config: the engine's shapes and strategies.
    sampling: sampling params, compiled in.
    model_config: the target's architecture.
    graphdef: the target's `nnx` graph definition; its params are an argument of every step.
    drafter_graphdef: the drafter's, or None without a drafter.
    dtype: the target's compute dtype (caches and captured features use it).
  """

  config: EngineConfig
  sampling: SamplingParams
  model_config: ModelConfig
  graphdef: nnx.GraphDef
  drafter_graphdef: nnx.GraphDef | None
  dtype: jnp.dtype

  def models(self, params: nnx.State, drafter_params: nnx.State | None) -> tuple[transformer.CausalLM, Drafter | None]:
    """The target and the drafter (None without one) with these params."""
    model = nnx.merge(self.graphdef, params)
    drafter = None if self.drafter_graphdef is None else nnx.merge(self.drafter_graphdef, drafter_params)
    return model, drafter

  def _cache(self, b: int, pages_BxM, num_layers: int | None = None) -> KVCache:
    """An empty cache for B rows: contiguous, or the pool of a paged one with these page tables."""
    cfg, mc = self.config, self.model_config
    if cfg.paged:
      return KVCache.paged(mc, pages_BxM, cfg.pool_pages, cfg.page_size, self.dtype, num_layers)
    return KVCache.zeros(mc, b, cfg.capacity, self.dtype, num_layers)

  def init(self, slots: SlotRows, pages_BxM=None) -> RowState:
    """A state of B = len(slots.row_id) slots with these rows in them and nothing generated yet:
    zero caches (paged: an empty pool, rows holding `pages_BxM`), counters and outputs, an empty
    bank; slots with `row_id < 0` are done."""
    cfg, mc = self.config, self.model_config
    b, n = slots.row_id.shape[0], self.sampling.max_new_tokens
    zeros = jnp.zeros((b,), jnp.int32)
    drafting = self.drafter_graphdef is not None
    banking = cfg.banking
    return RowState(
        cache=self._cache(b, pages_BxM), last_token=zeros, num_generated=zeros,
        max_new=slots.max_new, done=slots.row_id < 0, finish=zeros, prompt_index=slots.prompt_index,
        sample_index=slots.sample_index, row_id=slots.row_id, tokens=jnp.zeros((b, n), jnp.int32),
        logprobs=jnp.zeros((b, n), jnp.float32),
        hidden=jnp.zeros((b, n, mc.hidden_size), self.dtype) if cfg.capture_hidden else None, passes=zeros,
        prompt_hidden=jnp.zeros((b, cfg.max_prompt_len, mc.hidden_size), self.dtype) if cfg.capture_hidden else None,
        drafter_cache=self._cache(b, pages_BxM, num_layers=1) if drafting else None,
        draft_feat=jnp.zeros((b, mc.hidden_size), self.dtype) if drafting else None,
        drafter_finite=jnp.ones((b,), bool) if drafting else None,
        bank=jnp.full((cfg.bank_rows, cfg.suffix_bank_len), -1, jnp.int32) if banking else None,
        bank_row=slots.bank_row if banking else None, bank_offset=slots.bank_offset if banking else None,
        bank_room=slots.bank_room if banking else None)

  def reset(self, st: RowState, slots: SlotRows, clear_bank) -> RowState:
    """Empties the slots with `slots.row_id >= 0` for those new rows (identity, budget, bank place;
    counters and outputs as `init` makes them), ready for `prefill`; other slots are unchanged, and
    so are the bank rows but those `clear_bank` (bool [bank_rows]) marks, emptied for new prompts.
    The caches are left as they are: the prefill writes a new row's prompt slots and lengths, and
    nothing reads past them."""
    fresh, new_B = self.init(slots, st.cache.pages), slots.row_id >= 0  # its caches go unused
    out = jax.tree.map(lambda new, old: _where_rows(new_B, new, old), fresh.per_row(), st.per_row())
    bank = None if st.bank is None else jnp.where(clear_bank[:, None], -1, st.bank)
    return dataclasses.replace(out, cache=st.cache, drafter_cache=st.drafter_cache, bank=bank)

  def _drafter_pass(self, model, drafter, dcache: KVCache, features_BxMxH, tokens_BxM, kv_block, attention=None):
    """The drafter over pairs (f_p, x_{p+1}) at positions `dcache.lengths + j`: its outputs [B, M, H]
    and the cache with their keys/values written (lengths not advanced). `attention`: the
    engine's implementation unless given."""
    b, m = tokens_BxM.shape
    positions = dcache.lengths[:, None] + jnp.arange(m)[None]
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((m, m), bool)), (b, m, m))
    return drafter(model, features_BxMxH, tokens_BxM, positions, dcache, causal, kv_block=kv_block,
                   attention=attention or self.config.attention)

  def feed_drafter(self, model, drafter, st: RowState, pairs: CommittedPairs, kv_block: int | None) -> RowState:
    """Writes the committed pairs (f_p, x_{p+1}) into the drafter cache and advances its lengths;
    keeps the last output as `draft_feat` and whether it was finite in `drafter_finite`. Rows
    without pairs write nothing into a paged cache: a row entering has a stale length until its
    prefill, which could point into its prompt's shared pages."""
    dcache, count_B = st.drafter_cache, pairs.count
    if dcache.pages is not None:
      dcache = dataclasses.replace(dcache, pages=jnp.where((count_B > 0)[:, None], dcache.pages, dcache.k.shape[1]))
    out, dcache = self._drafter_pass(model, drafter, dcache, pairs.features, pairs.tokens, kv_block)
    dcache = dataclasses.replace(dcache, pages=st.drafter_cache.pages)
    last = out[jnp.arange(count_B.shape[0]), jnp.maximum(count_B - 1, 0)]
    finite = jnp.isfinite(last).all(-1) | (count_B == 0)
    # In the state's dtype (the target's): a float32 drafter beside a bfloat16 target feeds its output to
    # the target's lm_head and its own embedding input at the target's dtype anyway.
    return dataclasses.replace(st, drafter_cache=dataclasses.replace(dcache, lengths=dcache.lengths + count_B),
                               draft_feat=jnp.where((count_B > 0)[:, None], last.astype(st.draft_feat.dtype),
                                                    st.draft_feat),
                               drafter_finite=st.drafter_finite & finite)

  def prefill(self, params, drafter_params, st: RowState, tokens_PxT, lengths_P, row_prompt_B, history_PxH,
              write_from_B, pages_BxM=None) -> RowState:
    """Prefills P unique prompts (`tokens_PxT` right-padded, `lengths_P` tokens each) and writes each
    into its rows' caches: slot b gets prompt `row_prompt_B[b]` (-1: the slot is left as it is), its
    prompt slots from `write_from_B[b]` on (a paged cache's shared prompt pages are written by one
    of their rows, the others start past them; `pages_BxM` the page tables, None: contiguous). Each
    row's first token is sampled, and with a drafter, the drafter is fed the row's prompt pairs.
    With a bank, each prompt and its history (`history_PxH`, H = `suffix_history_len`, -1 padded)
    go to its bank row."""
    model, drafter = self.models(params, drafter_params)
    st = with_pages(st, pages_BxM)
    p, t = tokens_PxT.shape
    layers = drafter.feature_layers if drafter is not None else ()
    out = transformer.prefill(model, tokens_PxT, lengths_P, KVCache.zeros(self.model_config, p, t, self.dtype),
                              hidden_layers=layers)
    sel, src = row_prompt_B >= 0, jnp.maximum(row_prompt_B, 0)
    slots = jnp.broadcast_to(jnp.arange(t)[None], (src.shape[0], t))
    keep = sel[:, None] & (slots >= write_from_B[:, None]) & (slots < lengths_P[src][:, None])

    def write(cache: KVCache, new: KVCache, lengths_B) -> KVCache:
      """The rows' prompt slots `keep` from the unique prompts' cache `new`; lengths set for `sel`."""
      page, offset = layout.address(cache.pages, slots, cache.k.shape[2], cache.k.shape[1])
      page = jnp.where(keep, page, cache.k.shape[1])  # out of the pool: dropped
      put = lambda pool, x: pool.at[:, page, offset].set(x[:, src], mode="drop")
      return dataclasses.replace(cache, k=put(cache.k, new.k), v=put(cache.v, new.v),
                                 lengths=jnp.where(sel, lengths_B, cache.lengths))

    cache = write(st.cache, out.cache, lengths_P[src])
    rows = jnp.arange(src.shape[0])
    last = jnp.maximum(lengths_P[src] - 1, 0)
    if st.bank is not None:  # the prompt, right-aligned to max_prompt_len (every row of it writes the same)
      j = jnp.arange(t)[None]
      at = self.config.max_prompt_len - lengths_P[src][:, None] + j
      at = jnp.where(sel[:, None] & (j < lengths_P[src][:, None]), at, st.bank.shape[1])
      bank = st.bank.at[st.bank_row[:, None], at].set(tokens_PxT[src], mode="drop")
      h = history_PxH.shape[1]
      if h:  # the bank row's last h slots
        at = jnp.where(sel[:, None], st.bank.shape[1] - h + jnp.arange(h)[None], st.bank.shape[1])
        bank = bank.at[st.bank_row[:, None], at].set(history_PxH[src], mode="drop")
      st = dataclasses.replace(st, bank=bank)
    if st.prompt_hidden is not None:
      old = st.prompt_hidden[:, :t]
      st = dataclasses.replace(st, prompt_hidden=st.prompt_hidden.at[:, :t].set(
          _where_rows(sel, out.hidden[src].astype(old.dtype), old)))
    acc = speculative.accept(out.logits[src][:, None], speculative.root_only(st.last_token), sel, st.num_generated,
                             st.max_new, st.prompt_index, st.sample_index, self.sampling, 0)
    st = record(dataclasses.replace(st, cache=cache), jnp.zeros_like(sel), acc, out.hidden[src][rows, last][:, None])
    if drafter is None:
      return st
    # The drafter's prompt pairs (f_p, x_{p+1}), p < length - 1, are the same for every sample of a
    # prompt: they run once per unique prompt and are written into its rows, like the target's cache.
    # The last pair holds the row's own first token, so it is fed per row.
    features = drafter.target_features(out.hidden, out.aux_hidden)
    shifted = jnp.concatenate([tokens_PxT[:, 1:], jnp.zeros((p, 1), jnp.int32)], axis=1)
    _, shared = self._drafter_pass(model, drafter, drafter.empty_cache(p, t, self.dtype), features, shifted, None)
    dcache = write(st.drafter_cache, shared, last)
    first = CommittedPairs(features[src][rows, last][:, None], acc.tokens[:, :1], sel.astype(jnp.int32))
    return self.feed_drafter(model, drafter, dataclasses.replace(st, drafter_cache=dcache), first, None)

  def prefill_tail(self, params, drafter_params, st: RowState, slot, tokens_P, start, count, sibling,
                   pages_BxM) -> RowState:
    """`prefill` of one row (slot `slot`, int32 scalar) whose prompt's shared pages, slots below
    `start`, a sibling in flight (slot `sibling`) already wrote: only the prompt's tail, its
    `count` tokens from `start` on (`tokens_P`, padded to a tail bucket), runs through the target,
    attending to the shared pages, and the drafter is fed the tail's pairs. The row gets what a
    prefill gives it: its prompt's keys and values, its first token, its drafter feed, and with
    captured hidden states the prompt's (the shared part copied from the sibling's)."""
    model, drafter = self.models(params, drafter_params)
    st = with_pages(st, pages_BxM)
    b = st.last_token.shape[0]
    sel = jnp.arange(b) == slot
    layers = drafter.feature_layers if drafter is not None else ()

    def view(cache: KVCache, length) -> KVCache:  # the slot's view of the pool, `length` slots filled
      return dataclasses.replace(cache, pages=cache.pages[slot][None], lengths=jnp.reshape(length, (1,)))

    def put(cache: KVCache, written: KVCache, length) -> KVCache:  # the pool the view wrote, the slot's length
      return dataclasses.replace(written, pages=cache.pages, lengths=cache.lengths.at[slot].set(length))

    out = transformer.prefill(model, tokens_P[None], count[None], view(st.cache, start),
                              kv_block=self.config.kv_block, attention="xla", hidden_layers=layers)
    st = dataclasses.replace(st, cache=put(st.cache, out.cache, start + count))
    if st.prompt_hidden is not None:
      j = jnp.arange(st.prompt_hidden.shape[1])
      tail = st.prompt_hidden[slot].at[start + jnp.arange(tokens_P.shape[0])].set(
          out.hidden[0].astype(st.prompt_hidden.dtype), mode="drop")
      st = dataclasses.replace(st, prompt_hidden=st.prompt_hidden.at[slot].set(
          jnp.where((j < start)[:, None], st.prompt_hidden[sibling], tail)))
    logits = jnp.broadcast_to(out.logits, (b, out.logits.shape[-1]))[:, None]
    acc = speculative.accept(logits, speculative.root_only(st.last_token), sel, st.num_generated, st.max_new,
                             st.prompt_index, st.sample_index, self.sampling, 0)
    last = out.hidden[0, count - 1]
    st = record(st, jnp.zeros_like(sel), acc, jnp.broadcast_to(last, (b, last.shape[-1]))[:, None])
    if drafter is None:
      return st
    features = drafter.target_features(out.hidden, out.aux_hidden)  # [1, P, H]
    shifted = jnp.concatenate([tokens_P[1:], jnp.zeros((1,), jnp.int32)])[None]
    _, written = self._drafter_pass(model, drafter, view(st.drafter_cache, start), features, shifted, None, "xla")
    st = dataclasses.replace(st, drafter_cache=put(st.drafter_cache, written, start + count - 1))
    feature = features[0, count - 1]
    first = CommittedPairs(jnp.broadcast_to(feature, (b, feature.shape[-1]))[:, None], acc.tokens[:, :1],
                           sel.astype(jnp.int32))
    return self.feed_drafter(model, drafter, st, first, None)

  def resume(self, params, drafter_params, st: RowState, slot, tokens_R1, logprobs_R, count, pages_BxM) -> RowState:
    """Brings a preempted row back where it stopped (a paged cache): slot `slot` (int32 scalar) was
    just prefilled with the row's prompt; its `count` tokens generated before preemption
    (`tokens_R1[1:count + 1]`, with their `logprobs_R`; `tokens_R1[0]` is the prompt's last token)
    are prefilled after the prompt instead of being decoded again, and they replace the prefill's
    sample.

    The prefill starts one slot back, at the prompt's last token, so its outputs are the features
    of every generated token: captured hidden states are written as decoding writes them, and the
    drafter is fed the row's pairs (f_p, x_{p+1}) from there. It runs in chunks of at most
    `kv_block` tokens with blockwise attention (`xla`, for target and drafter: one row's view of a
    pool split over devices is not split like it), so a long row's prefill never holds more
    than a chunk's scores. The row's cache then holds its prompt and all but its last generated
    token, its next input, as if it had never left.
    """
    model, drafter = self.models(params, drafter_params)
    st = with_pages(st, pages_BxM)
    b, r = st.last_token.shape[0], logprobs_R.shape[0]
    c = math.gcd(r, self.config.kv_block)  # r is a power of two
    sel = jnp.arange(b) == slot
    chunks = lambda x: x.reshape(r // c, 1, c)  # [chunks, 1, c]
    layers = drafter.feature_layers if drafter is not None else ()

    def row(cache: KVCache | None) -> KVCache | None:  # the slot's view of the pool, at the prompt's last token
      if cache is None:
        return None
      return dataclasses.replace(cache, pages=cache.pages[slot][None], lengths=cache.lengths[slot][None] - 1)

    def put(cache: KVCache, view: KVCache) -> KVCache:  # the pool the view wrote, the slot's new length
      return dataclasses.replace(view, pages=cache.pages, lengths=cache.lengths.at[slot].set(view.lengths[0]))

    def chunk(carry, xs):
      i, cache, dcache, last = carry
      chain, generated = xs
      n = jnp.clip(count - i * c, 0, c)[None]
      out = transformer.prefill(model, chain, n, cache, kv_block=self.config.kv_block, attention="xla",
                                hidden_layers=layers)
      if drafter is not None:
        features = drafter.target_features(out.hidden, out.aux_hidden)
        fed, dcache = self._drafter_pass(model, drafter, dcache, features, generated, self.config.kv_block, "xla")
        dcache = dataclasses.replace(dcache, lengths=dcache.lengths + n)
        last = jnp.where(n[0] > 0, fed[0, jnp.maximum(n[0] - 1, 0)], last)
      return (i + 1, out.cache, dcache, last), out.hidden[0]

    feat0 = None if drafter is None else st.draft_feat[slot].astype(jnp.float32)
    (_, cache, dcache, last), hidden = jax.lax.scan(
        chunk, (jnp.int32(0), row(st.cache), row(st.drafter_cache), feat0),
        (chunks(tokens_R1[:-1]), chunks(tokens_R1[1:])))
    st = dataclasses.replace(st, cache=put(st.cache, cache), num_generated=jnp.where(sel, 0, st.num_generated),
                             done=st.done & ~sel, finish=jnp.where(sel, 0, st.finish))
    zeros = jnp.zeros((b,), bool)
    acc = speculative.Accepted(tokens=jnp.broadcast_to(tokens_R1[1:], (b, r)),
                               logprobs=jnp.broadcast_to(logprobs_R, (b, r)), nodes=jnp.zeros((b, r), jnp.int32),
                               count=jnp.where(sel, count, 0), stop=zeros, length=zeros)
    hidden = jnp.broadcast_to(hidden.reshape(1, r, -1), (b, r, hidden.shape[-1]))
    st = record(st, jnp.zeros((b,), jnp.int32), acc, hidden)
    if drafter is None:
      return st
    return dataclasses.replace(st, drafter_cache=put(st.drafter_cache, dcache),
                               draft_feat=st.draft_feat.at[slot].set(last.astype(st.draft_feat.dtype)),
                               drafter_finite=st.drafter_finite.at[slot].set(jnp.isfinite(last).all()))

  def draft(self, model, drafter, head, st: RowState, strategy: Strategy):
    """The EAGLE drafter's tree for every row (`speculative.draft_tree`, coupled to the rows' sampling
    keys) and its cache with the levels written; `head` is `drafter.head(model)`."""
    def draft_fn(cache, feats, tokens, positions, mask):
      return drafter(model, feats, tokens, positions, cache, mask, kv_block=self.config.kv_block,
                     attention=self.config.attention)

    keys = speculative.draft_keys(self.sampling, st.prompt_index, st.sample_index, st.num_generated,
                                  strategy.depth)
    return speculative.draft_tree(draft_fn, lambda f: drafter.logits(model, head, f), st.draft_feat, st.last_token,
                                  st.drafter_cache, strategy, drafter.target_ids, self.sampling, keys,
                                  model.config.vocab_size)

  def verify_step(self, model, drafter, st: RowState, tree: speculative.Tree, depth: int) -> Verified:
    """Verifies `tree` (paths at most `depth` below the root) for every active row and commits the
    accepted path; with the one-node tree (depth 0) this is a plain step. Returns the state and,
    with a drafter, the committed pairs for it."""
    active = ~st.done
    out = self._forward(model, drafter, st, tree)
    acc = speculative.accept(out.logits, tree, active, st.num_generated, st.max_new, st.prompt_index,
                             st.sample_index, self.sampling, depth)
    if depth:
      cache = speculative.commit(out.cache, acc.nodes, acc.count)
    else:  # a one-node tree: the accepted token's keys/values are already at the row's length
      cache = dataclasses.replace(out.cache, lengths=out.cache.lengths + acc.count)
    return self._commit(drafter, st, cache, out, acc, active)

  def _forward(self, model, drafter, st: RowState, tree: speculative.Tree):
    """The target over every row's tree at its length (keys and values written there)."""
    layers = drafter.feature_layers if drafter is not None else ()
    return transformer.verify(model, tree.tokens, st.cache.lengths[:, None] + tree.depths, tree.mask, st.cache,
                              kv_block=self.config.kv_block, attention=self.config.attention, hidden_layers=layers)

  @staticmethod
  def _commit(drafter, st: RowState, cache: KVCache, out, acc: speculative.Accepted, passes_B) -> Verified:
    """Records the emitted tokens `acc` (the features of the nodes that produced them) with the committed
    `cache`; with a drafter, the committed pairs for it."""
    rows = jnp.arange(acc.nodes.shape[0])[:, None]
    st = record(dataclasses.replace(st, cache=cache), passes_B, acc, out.hidden[rows, acc.nodes])
    if drafter is None:
      return Verified(st, None)
    return Verified(st, CommittedPairs(drafter.target_features(out.hidden, out.aux_hidden)[rows, acc.nodes], acc.tokens,
                              acc.count))

  def extend(self, params, drafter_params, st: RowState, tokens_BxC, count_B, pages_BxM=None) -> RowState:
    """Appends to each row `count_B` (0: none) of its `tokens_BxC`, a tool turn's
    (`tlt_jax.rollout.tools`), as if it had decoded them, with log-prob 0, and the row decodes on:
    one forward of the chain of its last token and them, every row at once like a verify step
    (data-parallel: the rows split over a mesh as the state does), whose keys and values are already
    where a chain accepted whole commits them; the features recorded and the drafter's pairs are
    those decoding gives. Rows without tokens write nothing into a paged cache. Each row's budget
    must hold its tokens (the engine checks)."""
    model, drafter = self.models(params, drafter_params)
    st = with_pages(st, pages_BxM)
    b, c = tokens_BxC.shape
    some = count_B > 0
    cache = st.cache
    if cache.pages is not None:
      cache = dataclasses.replace(cache, pages=jnp.where(some[:, None], cache.pages, cache.k.shape[1]))
    depths = jnp.broadcast_to(jnp.arange(c), (b, c))
    chain = jnp.concatenate([st.last_token[:, None], tokens_BxC[:, :-1]], axis=1)  # node j produces token j
    tree = speculative.Tree(chain, depths - 1, depths, jnp.broadcast_to(jnp.tril(jnp.ones((c, c), bool)), (b, c, c)))
    out = self._forward(model, drafter, dataclasses.replace(st, cache=cache), tree)
    no = jnp.zeros((b,), bool)
    acc = speculative.Accepted(tokens_BxC, jnp.zeros((b, c), jnp.float32), depths, count_B, no, no)
    cache = dataclasses.replace(out.cache, pages=st.cache.pages, lengths=out.cache.lengths + count_B)
    st = dataclasses.replace(st, done=st.done & ~some, finish=jnp.where(some, 0, st.finish))
    verified = self._commit(drafter, st, cache, out, acc, jnp.zeros((b,), jnp.int32))
    if drafter is None:
      return verified.state
    return self.feed_drafter(model, drafter, verified.state, verified.pairs, self.config.kv_block)

  def segment(self, params, drafter_params, st: RowState, stop_at, pages_BxM=None, max_steps=None, *,
              strategy: Strategy | None) -> RowState:
    """One play: up to `segment_steps` iterations (or `max_steps`, an int32 scalar, if fewer) of
    plain decoding (`strategy` None) or of draft -> verify -> accept -> commit -> drafter feed, in
    one `lax.while_loop` on the device, with the host's page tables `pages_BxM` (paged caches; they
    hold the slots the play may write).

    The loop runs at least once and ends early once at most `stop_at` (int32 scalar) rows are
    active (every row done, a smaller batch bucket fits the rest, or the tail begins), or,
    speculating, once a drafter output is not finite (the host then turns speculation off). A
    plain segment collects its committed pairs and feeds them to the drafter in ONE call at the
    end (a chunk of up to `segment_steps` positions, like a prefill), so the drafter cache is
    current at every play boundary, ready for the bandit to switch speculation on.
    """
    model, drafter = self.models(params, drafter_params)
    st = with_pages(st, pages_BxM)
    n, b = self.config.segment_steps, st.last_token.shape[0]
    limit = n if max_steps is None else jnp.minimum(max_steps, n)
    kv_block = self.config.kv_block
    rows = jnp.arange(b)

    def running(c: _Carry):
      go = (c.step < limit) & ((c.step == 0) | (jnp.sum(~c.state.done) > stop_at))
      return go if strategy is None or drafter is None else go & jnp.all(c.state.drafter_finite)

    if strategy is not None:
      if strategy.suffix:
        def draft(st):
          bank_BxL = st.bank[st.bank_row]
          context = suffix.context(bank_BxL, st.tokens, st.num_generated, self.config.max_prompt_len,
                                   self.config.suffix_ngram)
          return suffix.draft_tree(bank_BxL, context, st.last_token, strategy), st
      else:
        head = drafter.head(model)  # gathered once per play, outside the loop

        def draft(st):
          tree, dcache = self.draft(model, drafter, head, st, strategy)
          return tree, dataclasses.replace(st, drafter_cache=dcache)

      def speculate(c: _Carry) -> _Carry:
        tree, st = draft(c.state)
        verified = self.verify_step(model, drafter, st, tree, strategy.depth)
        # Suffix drafts too feed a drafter its committed pairs: an EAGLE arm may play next.
        st = verified.state if drafter is None else self.feed_drafter(model, drafter, verified.state,
                                                                      verified.pairs, kv_block)
        return _Carry(c.step + 1, st)

      return jax.lax.while_loop(running, speculate, _Carry(jnp.int32(0), st)).state

    def step(c: _Carry) -> _Carry:
      verified = self.verify_step(model, drafter, c.state, speculative.root_only(c.state.last_token), 0)
      pairs, new = c.pairs, verified.pairs
      if pairs is not None:  # append each row's committed pair (0 or 1 of them) at its own count
        at = jnp.where(new.count > 0, pairs.count, n)  # n: dropped
        features = pairs.features.at[rows, at].set(new.features[:, 0].astype(pairs.features.dtype), mode="drop")
        pairs = CommittedPairs(features, pairs.tokens.at[rows, at].set(new.tokens[:, 0], mode="drop"),
                               pairs.count + new.count)
      return _Carry(c.step + 1, verified.state, pairs)

    pairs = None
    if drafter is not None:
      pairs = CommittedPairs(jnp.zeros((b, n, st.draft_feat.shape[-1]), self.dtype), jnp.zeros((b, n), jnp.int32),
                    jnp.zeros((b,), jnp.int32))
    out = jax.lax.while_loop(running, step, _Carry(jnp.int32(0), st, pairs))
    return out.state if out.pairs is None else self.feed_drafter(model, drafter, out.state, out.pairs, kv_block)
