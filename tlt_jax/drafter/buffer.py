"""DataBuffer: the drafter's online training data, as the rollout captured it (no recomputation).

An entry is one finished sequence x_0..x_{L-1} (prompt x_0..x_{P-1}, response x_P..) with the
target features f_0..f_{L-2} the rollout computed anyway (`Sample.prompt_hidden` and
`Sample.hidden` from an engine with `capture_hidden`). Slot t holds the EAGLE pair
(f_t, x_{t+1}) and predicts f_{t+1} (the pairing the reference's online trainer gets off by
one); slots whose x_{t+1} is a prompt token are context with weight 0, as in offline
distillation, so the drafter learns with the prompt in its attention as it drafts. A sequence
longer than a row is cut into windows of `row_len` slots; positions restart at 0 per window,
which RoPE (relative) does not see.

One-step offset: step s trains on the samples of step s finished so far (the short ones finish
first) plus the longest `long_fraction` of step s-1's samples, so long sequences are in the
mix before this step's own long ones are done. Everything older is dropped when a step starts.

Bounded: at most `max_pairs` pairs are held; beyond that the oldest entries go first (step s-1
before step s, earlier before later). Every `eval_every`-th sample added is held out of training
for the held-out top-1 metric.

Tool turns (`Sample.tool_mask`): a slot whose prediction is of a tool token (a tool result, the
template around it) is context with weight 0 too: the drafter drafts the model's tokens only.

Batches are packed with `packing.pack` over pair indices, into fixed-shape `train.Pairs` whose
segment ids keep packed samples from attending to each other.

Checkpoints: `state_dict()` is every entry as arrays (tokens and features concatenated, a table
of each entry's step, length, prompt context and held-out flag) plus the step and the count of
samples added; `load_state_dict` rebuilds the same entries, so a resumed run draws the same
batches as an uninterrupted one. Its size is bounded by `max_pairs` (`BufferConfig.state_bytes`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from tlt_jax import fields
from tlt_jax.drafter.train import Pairs
from tlt_jax.packing import pack


_TABLE_FIELDS = ("step", "length", "first", "held_out")  # the columns of state_dict()'s "entries" table
_TABLE = np.dtype(np.int32)


@dataclasses.dataclass(frozen=True)
class BufferConfig:
  """The online drafter data buffer's bounds. Config: `drafter.buffer`."""

  max_pairs: int = 1 << 18  # bound on stored pairs (each: H features + a token)
  long_fraction: float = 0.25  # the longest part of the previous step kept for the offset rule
  eval_every: int = 16  # every n-th sample added is held out (0: none)

  def __post_init__(self):
    fields.at_least(self, 1, "max_pairs")
    fields.require(0 <= self.long_fraction <= 1, "long_fraction", self.long_fraction, "must be in [0, 1]")
    fields.at_least(self, 0, "eval_every")

  def state_bytes(self, samples_per_step: int, max_len: int, hidden_size: int, itemsize: int) -> int:
    """Upper bound of the bytes of `DataBuffer.state_dict()` when every RL step adds
    `samples_per_step` samples of at most `max_len` tokens (prompt + response) with `hidden_size`
    features of `itemsize` bytes each."""
    # At a checkpoint (after a rollout): this step's samples and the kept part of the previous one's.
    entries = samples_per_step + int(round(samples_per_step * self.long_fraction))
    pairs = min(self.max_pairs, entries * max(max_len - 2, 1))  # an entry of L tokens: L - 1 slots, L - 2 pairs
    entries = min(entries, pairs)  # each entry holds a pair at least
    per_token = hidden_size * itemsize + 5  # its features, its token and its tool flag
    return (pairs + entries) * per_token + entries * _TABLE.itemsize * len(_TABLE_FIELDS)


@dataclasses.dataclass
class Entry:
  step: int
  tokens: np.ndarray  # int32 [L-1]: x_1..x_{L-1}
  hidden: np.ndarray  # [L-1, H]: f_0..f_{L-2}; hidden[i] produced tokens[i]
  first: int  # slots before this one are prompt context (weight 0): P - 1
  held_out: bool
  tool: np.ndarray | None = None  # bool [L-1]: tokens[i] came from a tool turn (None: none did)

  def context(self) -> np.ndarray:
    """bool per slot: its prediction, f_{t+1} (which produces x_{t+2}), is of a tool token: weight 0."""
    return np.zeros((self.pairs,), bool) if self.tool is None else self.tool[1:].copy()

  @property
  def pairs(self) -> int:
    """Slots (context included): the last feature has no successor."""
    return len(self.tokens) - 1

  @property
  def response_pairs(self) -> int:
    return self.pairs - self.first


class DataBuffer:
  """Responses with their captured features, per RL step; see the module docstring."""

  def __init__(self, config: BufferConfig = BufferConfig()):
    self.config = config
    self.step = -1
    self.entries: list[Entry] = []
    self.added = 0  # samples ever added (drives the held-out choice)

  @property
  def num_pairs(self) -> int:
    return sum(e.pairs for e in self.entries)

  def add(self, step: int, samples: Sequence, prompts: Sequence[Sequence[int]]) -> None:
    """Adds finished rollout `samples` of RL step `step` (engine `Sample`s with `hidden` and
    `prompt_hidden`; `prompts[s.prompt_index]` is the prompt of sample s)."""
    if step < self.step:
      raise ValueError(f"buffer is at step {self.step}; cannot add samples of the earlier step {step}")
    if step > self.step:
      self._advance(step)
    for s in samples:
      if s.hidden is None or s.prompt_hidden is None:
        raise ValueError(f"sample (prompt {s.prompt_index}, sample {s.sample_index}) has no hidden states: "
                         "the rollout engine needs capture_hidden=True")
      prompt = prompts[s.prompt_index]
      if len(s.hidden) != len(s.tokens) or len(s.prompt_hidden) != len(prompt):
        raise ValueError(f"sample (prompt {s.prompt_index}, sample {s.sample_index}): {len(prompt)} prompt and "
                         f"{len(s.tokens)} response tokens but {len(s.prompt_hidden)} and {len(s.hidden)} "
                         "hidden states")
      self.added += 1
      if len(s.tokens) < 2:  # no response pair
        continue
      held_out = self.config.eval_every > 0 and self.added % self.config.eval_every == 0
      tokens = np.concatenate([np.asarray(prompt[1:], np.int32), np.asarray(s.tokens, np.int32)])
      hidden = np.concatenate([np.asarray(s.prompt_hidden[:-1]), np.asarray(s.hidden)])  # f_{P-1} is hidden[0]
      tool = None
      if getattr(s, "tool_mask", None) is not None and s.tool_mask.any():
        tool = np.concatenate([np.zeros((len(prompt) - 1,), bool), s.tool_mask])
      self.entries.append(Entry(step, tokens, hidden, len(prompt) - 1, held_out, tool))
    self._evict()

  def _evict(self) -> None:
    total = self.num_pairs
    while total > self.config.max_pairs:
      total -= self.entries.pop(0).pairs

  def _advance(self, step: int) -> None:
    """Keeps the longest `long_fraction` of the current step's training entries as the offset."""
    previous = [e for e in self.entries if e.step == self.step and not e.held_out] if step == self.step + 1 else []
    keep = int(round(len(previous) * self.config.long_fraction))
    order = sorted(range(len(previous)), key=lambda i: -previous[i].response_pairs)[:keep]
    self.entries = [previous[i] for i in sorted(order)]  # insertion order: eviction stays oldest-first
    self.step = step

  def training_entries(self) -> list[Entry]:
    """What `batch` samples from: this step's finished samples + the previous step's long ones."""
    return [e for e in self.entries if not e.held_out]

  def held_out_entries(self) -> list[Entry]:
    return [e for e in self.entries if e.held_out and e.step == self.step]

  def batch(self, rng: np.random.Generator, rows: int, row_len: int) -> Pairs:
    """`rows` packed rows of `row_len` pairs drawn at random (without replacement) from the training entries."""
    entries = self.training_entries()
    if not entries:
      raise ValueError(f"the drafter buffer has no training samples at step {self.step}")
    chosen, room = [], rows * row_len
    for i in rng.permutation(len(entries)):
      chosen.append(entries[i])
      room -= entries[i].pairs
      if room <= 0:
        break
    return self._pack(chosen, rows, row_len, rng)

  def eval_batch(self, rows: int, row_len: int) -> Pairs | None:
    """The current step's held-out samples packed into at most `rows` rows (None when there are none)."""
    entries = self.held_out_entries()
    return self._pack(entries, rows, row_len, None) if entries else None

  def packed(self, row_len: int) -> Pairs:
    """Every training entry, packed into as many rows of `row_len` pairs as it takes (offline distillation
    from captured features: `train.distill` takes them as they are)."""
    entries = self.training_entries()
    if not entries:
      raise ValueError("the drafter buffer has no training samples")
    return self._pack(entries, None, row_len, None)

  @staticmethod
  def _pack(entries: Sequence[Entry], rows: int | None, row_len: int, rng: np.random.Generator | None) -> Pairs:
    tokens = np.concatenate([e.tokens[:-1] for e in entries])
    hidden = np.concatenate([e.hidden[:-1] for e in entries])
    next_hidden = np.concatenate([e.hidden[1:] for e in entries])
    context = np.concatenate([e.context() for e in entries])
    starts = np.cumsum([0] + [e.pairs for e in entries])
    # Pack slot indices into the arrays above: a window is a (context, trained) pair of index lists.
    windows = []
    for e, start, end in zip(entries, starts[:-1], starts[1:]):
      for a in range(start, end, row_len):
        b = min(a + row_len, end)
        first = min(max(start + e.first, a), b)  # a window inside the prompt is all context (dropped)
        windows.append((list(range(a, first)), list(range(first, b))))
    planes = pack(windows, row_len)
    rows = planes.shape[1] if rows is None else rows
    take = np.arange(planes.shape[1]) if rng is None else rng.permutation(planes.shape[1])
    planes = planes[:, np.sort(take[:rows])]
    planes = np.pad(planes, ((0, 0), (0, rows - planes.shape[1]), (0, 0)))
    index, positions, segments, trained = planes
    real = segments > 0
    zero_pad = lambda x: np.where(real[..., None], x, 0).astype(hidden.dtype)
    return Pairs(tokens=np.where(real, tokens[index], 0).astype(np.int32), positions=positions, segments=segments,
                 weights=(real & (trained > 0) & ~context[index]).astype(np.float32), hidden=zero_pad(hidden[index]),
                 aux=(),
                 next_hidden=zero_pad(next_hidden[index]))

  def metadata(self) -> dict:
    """JSON-able summary for metrics and logs."""
    return {"step": self.step, "entries": len(self.entries), "pairs": self.num_pairs, "added": self.added}

  def state_dict(self) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, JSON-able metadata): everything the next batches depend on (module docstring).

    arrays: "tokens" [N] int32, "tool" [N] bool and "hidden" [N, H] (every entry's, concatenated;
    [0, 0] float32 when empty), "entries" [E, 4] int32 (per entry: `_TABLE_FIELDS`)."""
    e = self.entries
    table = np.asarray([[x.step, len(x.tokens), x.first, x.held_out] for x in e], _TABLE)
    table = table.reshape(-1, len(_TABLE_FIELDS))
    arrays = {"tokens": np.concatenate([x.tokens for x in e]) if e else np.zeros(0, np.int32),
              "tool": np.concatenate([np.zeros(len(x.tokens), bool) if x.tool is None else x.tool for x in e]) if e
              else np.zeros(0, bool),
              "hidden": np.concatenate([x.hidden for x in e]) if e else np.zeros((0, 0), np.float32),
              "entries": table}
    return arrays, {"step": self.step, "added": self.added}

  def load_state_dict(self, arrays: dict[str, np.ndarray], metadata: dict) -> None:
    """Restores what `state_dict` returned (the bound of this buffer's config applies)."""
    table = np.asarray(arrays["entries"]).reshape(-1, len(_TABLE_FIELDS))
    tokens, hidden = np.asarray(arrays["tokens"]), np.asarray(arrays["hidden"])
    ends = np.cumsum(table[:, 1])
    total = int(ends[-1]) if len(ends) else 0
    if len(tokens) != total or len(hidden) != total:
      raise ValueError(f"drafter buffer state: its entries hold {total} tokens but it has {len(tokens)} tokens and "
                       f"{len(hidden)} feature rows")
    tool = np.asarray(arrays["tool"], bool) if "tool" in arrays else np.zeros(total, bool)  # older checkpoints
    self.entries = [Entry(int(step), tokens[end - n:end].copy(), hidden[end - n:end].copy(), int(first), bool(held),
                          tool[end - n:end].copy() if tool[end - n:end].any() else None)
                    for (step, n, first, held), end in zip(table, ends)]
    self.step, self.added = int(metadata["step"]), int(metadata["added"])
    self._evict()
