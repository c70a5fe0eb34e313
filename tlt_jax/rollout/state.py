"""The rollout engine's state and record types.

`EngineConfig` fixes what the engine compiles (batch and prompt buckets, capacities, strategies).
`RowState` is everything a rollout keeps on the device, one entry per batch slot ("row"): the
KV caches, the last token, counters, outputs and, with a drafter, its cache and last output. The
pure functions of `tlt_jax.rollout.steps` take it and return it; `SlotRows` says which row each
slot gets, `CommittedPairs` carries committed (feature, token) pairs to the drafter and `Verified`
is what a verify step returns.

The token bank of suffix strategies (`RowState.bank`, `tlt_jax.rollout.suffix`) is held per
prompt in flight, not per row: every prompt holds a row of it (its prompt and its samples'
tokens, written as they are accepted), so it follows prompts, not slots: compaction and refill
move rows, the bank stays, and a prompt's bank row is emptied for another prompt only after its
last row is harvested.

On the host, a rollout returns `Rollout`: its `Sample`s and `RolloutMetrics`, with one
`SegmentRecord` per play of the decode loop.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import numpy as np

from tlt_jax import fields
from tlt_jax.kernels import tree_attention
from tlt_jax.models.transformer import KVCache
from tlt_jax.rollout.speculative import Strategy

FINISH_REASONS = ("running", "stop", "length")  # `RowState.finish` indexes it


def _padded_lengths(limit: int) -> tuple[int, ...]:
  """Powers of two from 16, the last one `limit` itself."""
  sizes = [16]
  while sizes[-1] < limit:
    sizes.append(sizes[-1] * 2)
  return tuple(min(s, limit) for s in sizes)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """What an `Engine` compiles for: its shapes, buckets and draft strategies (each field says what it sets).
  Config: `rollout.engine` (max_prompt_len from `data`, max_new_tokens from `rollout.sampling`,
  strategies from `rollout.strategies`)."""

  batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # powers of two
  max_prompt_len: int = 256
  max_new_tokens: int = 256  # capacity; a rollout's SamplingParams may ask for fewer
  segment_steps: int = 16  # decode steps between host checks
  kv_block: int = 64  # attention block; the cache capacity is rounded up to a multiple
  attention: str = "auto"  # tree-attention implementation (`tlt_jax.kernels.tree_attention.select`)
  prefill_batch: int = 16  # unique prompts per prefill call
  compact: bool = True
  capture_hidden: bool = False  # keep the target's last hidden state of every prompt and generated token
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
  # The last this-many slots of a prompt's bank row hold tokens the caller gives with the prompt
  # (`Engine.generate(history=...)`: its responses in earlier epochs, `suffix.History`).
  suffix_history_len: int = 0
  # Paged KV caches (`tlt_jax.kernels.layout`): 0 gives each row its whole capacity (contiguous);
  # > 0 (a multiple of kv_block), the rows share a pool of `num_pages` pages of this many slots,
  # take them as they grow and give them back when they finish, and a prompt's samples share its
  # prompt's pages. `num_pages` 0: as many as the largest bucket's rows could fill.
  page_size: int = 0
  num_pages: int = 0

  def __post_init__(self):
    b = self.batch_buckets
    fields.require(b and b[0] == 1 and all(y == 2 * x for x, y in zip(b, b[1:])), "batch_buckets", b,
                   "must be 1, 2, 4, ... (powers of two)")
    fields.require(self.attention in tree_attention.IMPLEMENTATIONS, "attention", self.attention,
                   f"must be one of {tree_attention.IMPLEMENTATIONS}")
    fields.at_least(self, 1, "max_prompt_len", "max_new_tokens", "segment_steps", "kv_block", "prefill_batch",
                    "sd_max_batch", "suffix_ngram")
    fields.at_least(self, 2, "suffix_bank_len")  # a prompt token and a generated one
    fields.at_least(self, 0, "suffix_history_len", "page_size", "num_pages")
    fields.require(self.page_size % self.kv_block == 0, "page_size", self.page_size,
                   f"must be a multiple of kv_block={self.kv_block}")
    fields.require(not self.num_pages or self.num_pages >= self.pages_per_row, "num_pages", self.num_pages,
                   f"must be 0 or at least the {self.pages_per_row} pages one row fills (page_size={self.page_size})")
    fields.require(0 <= self.refill_rows <= b[-1], "refill_rows", self.refill_rows,
                   f"must be in [0, {b[-1]}] (the largest bucket)")
    least = self.max_prompt_len + self.suffix_history_len + 2
    fields.require(not self.banking or self.suffix_bank_len >= least, "suffix_bank_len", self.suffix_bank_len,
                   f"must be >= max_prompt_len + suffix_history_len + 2 = {least} (the prompt, its history and a "
                   "token)")

  @property
  def banking(self) -> bool:
    """Rows bank their tokens for suffix strategies."""
    return any(s.suffix for s in self.strategies)

  @property
  def bank_rows(self) -> int:
    """Prompts in flight at most: the largest batch + 1 (see `suffix.BankRows`); 0 without suffix strategies."""
    return self.batch_buckets[-1] + 1 if self.banking else 0

  def row_slots(self, prompt_len: int, budget: int) -> int:
    """Cache slots a row of `prompt_len` prompt tokens and `budget` new ones may write: a step at length n (the
    tokens in its cache) writes slots n .. n + window - 1 (a plain step: the last token, at n), and steps run
    while fewer than `budget` tokens are out, the last one never written, so n <= prompt_len + budget - 2; one
    slot spare."""
    return prompt_len + budget + max([s.window for s in self.strategies] + [1]) - 1

  @property
  def capacity(self) -> int:
    """Cache slots per row (`row_slots` at the longest prompt and budget), a multiple of the page or kv_block."""
    unit = self.page_size or self.kv_block
    return -(-self.row_slots(self.max_prompt_len, self.max_new_tokens) // unit) * unit

  @property
  def paged(self) -> bool:
    return self.page_size > 0

  @property
  def pages_per_row(self) -> int:
    """Pages a row holds at its capacity (1 without paging: its whole cache)."""
    return self.capacity // self.page_size if self.paged else 1

  @property
  def pool_pages(self) -> int:
    """Pages in the pool of a paged cache."""
    return self.num_pages or self.batch_buckets[-1] * self.pages_per_row

  @property
  def probe_steps(self) -> int:
    """Iterations of a play the bandit explores with: a quarter of a segment."""
    return max(1, self.segment_steps // 4)

  def play_slots(self, strategy: Strategy | None) -> int:
    """Cache slots past a row's length that one play of `strategy` (None: plain) may write."""
    if strategy is None:
      return self.segment_steps
    return self.segment_steps * (strategy.depth + 1) + strategy.window

  @property
  def prompt_buckets(self) -> tuple[int, ...]:
    """Padded prompt lengths: powers of two from 16, the last one max_prompt_len itself."""
    return _padded_lengths(self.max_prompt_len)

  def bucket(self, rows: int) -> int:
    """The smallest batch bucket that holds `rows` rows."""
    return next(b for b in self.batch_buckets if b >= rows)

  def prompt_bucket(self, n: int) -> int:
    """The padded length of a prompt of `n` tokens (`n <= max_prompt_len`)."""
    return next(t for t in self.prompt_buckets if t >= n)

  @property
  def resume_buckets(self) -> tuple[int, ...]:
    """Padded lengths of a preempted row's tokens prefilled again (`Steps.resume`; a paged cache):
    powers of two from 16 up to one that holds max_new_tokens."""
    return tuple(1 << i for i in range(4, max(4, (self.max_new_tokens - 1).bit_length()) + 1)) if self.paged else ()

  @property
  def turn_chunk(self) -> int:
    """Tokens of tool turns appended per `Steps.extend` call (`tlt_jax.rollout.tools`; longer turns take
    several): one executable per batch bucket."""
    return 16

  def resume_bucket(self, n: int) -> int:
    return next(t for t in self.resume_buckets if t >= n)

  @property
  def tail_buckets(self) -> tuple[int, ...]:
    """Padded lengths of a prompt's tail after its shared pages (`Steps.prefill_tail`; a paged
    cache): powers of two from 16, the last one page_size (a tail fills one page at most)."""
    return _padded_lengths(self.page_size) if self.paged else ()

  def tail_bucket(self, n: int) -> int:
    return next(t for t in self.tail_buckets if t >= n)

  @property
  def refill_chunk(self) -> int:
    """Free slots at which waiting rows are refilled into the largest bucket."""
    return self.refill_rows or max(1, self.batch_buckets[-1] // 4)


@flax.struct.dataclass
class RowState:
  """A batch of B slots on the device: each holds a row (one sample of one prompt) or is empty.

  N is the engine's `max_new_tokens`, H the target's hidden size. The drafter fields are None
  without a drafter; `hidden` and `prompt_hidden` None unless the engine captures hidden states;
  the bank fields None without suffix strategies. `drafter_finite` is the guard: once a row's
  drafter outputs are not finite (NaN/inf drafter params or draft logits), the host turns
  speculation off for the rest of the rollout.
  """

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

  def per_row(self) -> RowState:
    """The fields with one entry per row: the caches and the bank (held per prompt) set to None."""
    return dataclasses.replace(self, cache=None, drafter_cache=None, bank=None)


@flax.struct.dataclass
class SlotRows:
  """Which row each of B slots gets (what `init` and `reset` write): its identity, budget and bank place.

  Every field is int32 [B]; `row_id` -1 marks a slot that gets no row.
  """

  prompt_index: jax.Array  # global prompt index (the RNG keys' and `Sample.prompt_index`)
  sample_index: jax.Array
  row_id: jax.Array  # the row's index in the rollout's rows, -1: none
  max_new: jax.Array  # budget: new tokens at most
  bank_row: jax.Array  # the prompt's bank row, and where the row's own tokens go in it (0 without a bank)
  bank_offset: jax.Array
  bank_room: jax.Array


@flax.struct.dataclass
class CommittedPairs:
  """Committed (feature, token) pairs for the drafter: pair j of row b is (f_p, x_{p+1})."""

  features: jax.Array  # [B, M, H]
  tokens: jax.Array  # [B, M]
  count: jax.Array  # [B] valid pairs per row (the first `count`)


@flax.struct.dataclass
class Verified:
  """What a verify step returns: the state with the accepted path committed, and the committed
  (feature, token) pairs for the drafter (None without a drafter)."""

  state: RowState
  pairs: CommittedPairs | None


@dataclasses.dataclass
class Sample:
  """One finished row on the host: its tokens, their log-probs and why it ended."""

  prompt_index: int
  sample_index: int
  tokens: np.ndarray  # int32 [n], the stop token included when one ended the row
  logprobs: np.ndarray  # float32 [n]
  finish_reason: str  # "stop" or "length"
  hidden: np.ndarray | None = None  # [n, H] when the engine captures hidden states
  prompt_hidden: np.ndarray | None = None  # [P, H] the prompt's features (its last one is hidden[0])
  # With tool turns (`tlt_jax.rollout.tools`): bool [n], True on the tokens tool turns appended (not the
  # model's: no loss, no drafter data, log-prob 0), and a record per tool call, in order. None/[] without.
  tool_mask: np.ndarray | None = None
  tool_calls: list[dict] = dataclasses.field(default_factory=list)

  def own(self, values: np.ndarray) -> np.ndarray:
    """`values` (one per token) of the model's own tokens: a tool turn's left out."""
    return values if self.tool_mask is None else values[~self.tool_mask]

  @property
  def answer(self) -> np.ndarray:
    """The tokens of the last assistant turn, after the last tool turn (all of them without one): what a
    reward scores."""
    if self.tool_mask is None or not self.tool_mask.any():
      return self.tokens
    return self.tokens[len(self.tool_mask) - int(np.argmax(self.tool_mask[::-1])):]

  @property
  def turns(self) -> int:
    """The trajectory's assistant turns (1 without tool turns)."""
    return 1 + (0 if self.tool_mask is None else int((np.diff(self.tool_mask.astype(np.int8)) == 1).sum()))


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
  probe: bool = False  # the bandit explored: a short play (`EngineConfig.probe_steps`)
  first_run: bool = False  # its executable's first run (one-time setup included: no reward for the bandit)


@dataclasses.dataclass
class RolloutMetrics:
  """A rollout's times (seconds), tokens and plays; properties and `summary` derive the rest."""

  prefill_s: float = 0.0
  decode_s: float = 0.0
  compact_s: float = 0.0
  tokens: int = 0
  segments: list[SegmentRecord] = dataclasses.field(default_factory=list)
  drafter_nonfinite: bool = False  # the drafter's outputs were NaN/inf: speculation was turned off
  refills: int = 0  # times waiting rows were prefilled into finished rows' slots
  preemptions: int = 0  # rows sent back to wait because the paged cache ran out of pages
  resumed_tokens: int = 0  # tokens preempted rows held, prefilled again when they came back (not decoded again)
  peak_rows: int = 0  # most rows in flight at once
  peak_pages: int = 0  # most pages held at once (paged caches)
  tool_calls: int = 0  # tool calls the rows made (`tlt_jax.rollout.tools`)
  tool_turns: int = 0  # tool turns appended to rows (a turn holds one or more calls)
  tool_tokens: int = 0  # tokens those turns appended (not decoded, not counted in `tokens`)
  tool_wait_s: float = 0.0  # time the host waited for tools with no row left to decode
  tool_append_s: float = 0.0  # time appending tool turns to their rows (`Steps.extend`)
  started: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (prompt, sample) in batch-entry order

  @property
  def wall_s(self) -> float:
    return self.prefill_s + self.decode_s + self.compact_s + self.tool_wait_s + self.tool_append_s

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
  def probe_s(self) -> float:
    """Seconds in the bandit's exploring plays (an arm measured: what learning the arms costs)."""
    return sum(s.seconds for s in self.segments if s.probe)

  @property
  def verify_passes(self) -> int:
    return sum(s.passes for s in self.segments if s.strategy)

  @property
  def accept_len(self) -> float:
    """Mean tokens emitted per speculative verify pass (bonus included); 0 without speculation."""
    return sum(s.tokens for s in self.segments if s.strategy) / max(self.verify_passes, 1)

  def summary(self) -> dict[str, float | int]:
    """Flat metrics record: times, tokens/s, acceptance, SD and exploring shares, steps per batch bucket, and
    how often each arm ("off" or a strategy) was played in the tail per batch bucket."""
    out = {"rollout/tokens": self.tokens, "rollout/tokens_per_s": self.tokens_per_s, "rollout/wall_s": self.wall_s,
           "rollout/prefill_s": self.prefill_s, "rollout/decode_s": self.decode_s, "rollout/compact_s": self.compact_s,
           "rollout/sd_s": self.sd_s, "rollout/plain_s": self.decode_s - self.sd_s,
           "rollout/sd_share": self.sd_s / max(self.wall_s, 1e-9), "rollout/probe_s": self.probe_s,
           "rollout/probe_share": self.probe_s / max(self.wall_s, 1e-9), "rollout/accept_len": self.accept_len,
           "rollout/verify_passes": self.verify_passes, "rollout/drafter_nonfinite": int(self.drafter_nonfinite),
           "rollout/refills": self.refills, "rollout/preemptions": self.preemptions,
           "rollout/resumed_tokens": self.resumed_tokens, "rollout/peak_rows": self.peak_rows,
           "rollout/peak_pages": self.peak_pages, "rollout/tool_calls": self.tool_calls,
           "rollout/tool_turns": self.tool_turns, "rollout/tool_tokens": self.tool_tokens,
           "rollout/tool_wait_s": self.tool_wait_s, "rollout/tool_append_s": self.tool_append_s,
           "rollout/tail_share": self.tail_share, "rollout/idle_slot_fraction": self.idle_slot_fraction}
    for s in self.segments:
      key = f"rollout/steps/b{s.bucket}"
      out[key] = out.get(key, 0) + s.steps
      if s.tail:
        key = f"bandit/b{s.bucket}/arm_{s.strategy or 'off'}"
        out[key] = out.get(key, 0) + 1
    return out


@dataclasses.dataclass
class Rollout:
  """What `Engine.generate` returns."""

  samples: list[Sample]  # ordered by (prompt_index, sample_index)
  metrics: RolloutMetrics
