"""Model-free drafts from the rollout itself: suffix matches in a token bank per prompt.

GRPO samples a group of responses per prompt; siblings repeat each other's steps and phrases, and
a response often repeats its prompt or itself. A suffix draft costs no forward pass: find where a
row's last n tokens occur in its prompt's bank (n up to `max_ngram`, longest first) and propose
what followed. Several matches give several branches (merged where they agree), one a chain; the
tree goes through the same verification as EAGLE drafts, so it is lossless by construction.

A bank row (`bank_len` tokens, -1 where empty) holds one prompt in flight: the prompt right-aligned
to `max_prompt_len` (so the prompt runs straight into sample 0's tokens), then one region per
sample, each ending with an empty slot that separates it from the next one:
  [ -1 .. -1 | prompt | sample 0 ... -1 | sample 1 ... -1 | ... ]
                      ^ max_prompt_len  ^ max_prompt_len + region
Rows write their accepted tokens into their own region as they go (`Layout.room` of them: a long
response's later tokens are matched against the bank but not banked), so the bank keeps finished
siblings' tokens after compaction or refill drops their rows. With `history_len` > 0 the row's
last slots hold the prompt's history, written with the prompt: its responses in earlier epochs,
newest first, each after the prompt's last tokens (so a fresh row's context, the end of its
prompt, matches where each earlier response began), kept by a `History` across rollouts.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from tlt_jax.rollout import speculative
from tlt_jax.rollout.speculative import Strategy, Tree


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a prompt's samples write in its bank row (host side: the sizes of one rollout)."""

  bank_len: int
  max_prompt_len: int
  num_samples: int
  max_new_tokens: int
  history_len: int = 0

  @property
  def region(self) -> int:
    """Slots per sample: its tokens and an empty separator (all the samples share the bank fairly)."""
    room = self.bank_len - self.max_prompt_len - self.history_len
    return min(room // self.num_samples, self.max_new_tokens + 1)

  def offset(self, sample_index: int) -> int:
    return self.max_prompt_len + sample_index * self.region

  @property
  def room(self) -> int:
    """Tokens of a sample its region holds (the first `room` of its response)."""
    return max(self.region - 1, 0)


def context(bank_BxL, tokens_BxN, num_generated_B, max_prompt_len: int, n: int):
  """[B, n] each row's last n tokens (prompt and response; -1 before its start): the response's from
  `tokens_BxN`, the prompt's from its bank row, where it is right-aligned to `max_prompt_len`."""
  b = tokens_BxN.shape[0]
  rows = jnp.arange(b)[:, None]
  index = num_generated_B[:, None] - n + jnp.arange(n)[None]  # into the response; < 0: the prompt's
  from_prompt = jnp.where(max_prompt_len + index >= 0, bank_BxL[rows, jnp.maximum(max_prompt_len + index, 0)], -1)
  return jnp.where(index >= 0, tokens_BxN[rows, jnp.maximum(index, 0)], from_prompt)


def draft_tree(bank_BxL, context_BxN, root_B, strategy: Strategy) -> Tree:
  """The suffix draft tree of each row: `bank_BxL` its prompt's bank row, `context_BxN` its last N
  tokens (the root last; -1: none), N the longest suffix matched.

  Every bank position i where the context's last l >= 1 tokens end (the longest such l) and a
  token follows is a match; the `top_k` matches with the longest l, then the most tokens to
  propose (up to `depth`; a row's latest match in its own tokens has few), then the latest,
  propose their next `depth` tokens (up to an empty slot). The continuations are merged into a
  trie: a node is a distinct prefix, scored by how many matches share it, then by their longest l
  (a prefix scores at least its extensions). `select_tree` keeps the best `verify_tokens - 1`.
  """
  b, length = bank_BxL.shape
  n = context_BxN.shape[1]
  k, depth = strategy.top_k, strategy.depth
  rows = jnp.arange(b)[:, None]
  # l at each position: how many of the context's last tokens match the bank, backwards from it.
  run = jnp.ones((b, length), bool)
  matched = jnp.zeros((b, length), jnp.int32)
  for m in range(n):
    q = context_BxN[:, n - 1 - m][:, None]
    earlier = jnp.pad(bank_BxL, ((0, 0), (m, 0)), constant_values=-1)[:, :length]  # bank[i - m]
    run = run & (earlier == q) & (q >= 0)
    matched = matched + run
  # The tokens that follow each position, up to depth (and the first empty slot).
  follow = jnp.zeros((b, length), jnp.int32)
  run = jnp.ones((b, length), bool)
  for e in range(1, depth + 1):
    run = run & (jnp.pad(bank_BxL[:, e:], ((0, 0), (0, e)), constant_values=-1) >= 0)
    follow = follow + run
  key = jnp.where((matched > 0) & (follow > 0), (matched * (depth + 1) + follow) * length + jnp.arange(length), -1)
  key, end = _top(key, k)  # [B, K]: longest match, then longest continuation, then latest
  found_BxK, l_BxK = key >= 0, jnp.maximum(key, 0) // (length * (depth + 1))
  at = end[:, :, None] + 1 + jnp.arange(depth)  # [B, K, D] the continuations
  token = jnp.where(at < length, bank_BxL[rows[:, :, None], jnp.minimum(at, length - 1)], -1)
  ok = jnp.cumprod((token >= 0) & found_BxK[:, :, None], axis=2).astype(bool)
  # same[b, i, j, d]: matches i and j share their continuation's first d + 1 tokens.
  same = (token[:, :, None] == token[:, None]) & ok[:, :, None] & ok[:, None]
  same = jnp.cumprod(same, axis=3).astype(bool)
  first = jnp.argmax(same, axis=2)  # [B, K, D] the first match with that prefix: the node's owner
  new = ok & (first == jnp.arange(k)[None, :, None])
  count = same.sum(axis=2)
  longest = jnp.max(jnp.where(same, l_BxK[:, None, :, None], 0), axis=2)
  score = jnp.where(new, count * (n + 1) + longest, -jnp.inf).astype(jnp.float32)
  # The pool, depth-major (node d * K + i) so that a parent precedes its children.
  d = jnp.arange(depth)[None, None]
  parent = jnp.where(d == 0, -1, (d - 1) * k + jnp.roll(first, 1, axis=2))  # the owner of the prefix one shorter
  pool = lambda x: jnp.swapaxes(x, 1, 2).reshape(b, depth * k)
  return speculative.select_tree(root_B, pool(jnp.maximum(token, 0)), pool(score), pool(parent),
                                 pool(jnp.broadcast_to(d + 1, token.shape)), strategy.verify_tokens, depth)


def _top(key_BxL, k: int):
  """The k largest keys per row and their positions, as top_k gives them where keys are >= 0 (they
  are distinct there; a -1, no match, may come with any position), by k argmaxes: XLA:CPU's top_k
  over int32 keys sorts the row, ~50 argmaxes' time over 4096 slots (0.67 vs 0.013 ms), the bulk
  of a suffix draft's cost."""
  values, positions = [], []
  for _ in range(k):
    at = jnp.argmax(key_BxL, axis=1)
    values.append(jnp.take_along_axis(key_BxL, at[:, None], axis=1)[:, 0])
    positions.append(at)
    key_BxL = jnp.where(jnp.arange(key_BxL.shape[1])[None] == at[:, None], -1, key_BxL)
  return jnp.stack(values, axis=1), jnp.stack(positions, axis=1)


class BankRows:
  """Host bookkeeping of one rollout's bank rows: a prompt holds one from its first row's entry
  until its last row is harvested (rows enter prompt by prompt, so with `slots` = the batch + 1
  there is always one free for a new prompt); each row writes at its sample's region."""

  def __init__(self, layout: Layout, slots: int, rows_per_prompt: dict[int, int]):
    self.layout = layout
    self._free = list(range(slots))[::-1]
    self._row: dict[int, int] = {}  # prompt -> its bank row
    self._left = dict(rows_per_prompt)  # prompt -> its rows not yet harvested
    self._fresh = np.zeros((slots,), bool)

  def place(self, prompt: int, sample: int) -> tuple[int, int, int]:
    """(bank row, offset, room) of a row entering the batch."""
    if prompt not in self._row:
      if not self._free:
        raise RuntimeError(f"prompt {prompt}: every one of the {len(self._fresh)} bank rows is in use")
      self._row[prompt] = self._free.pop()
      self._fresh[self._row[prompt]] = True
    return self._row[prompt], self.layout.offset(sample), self.layout.room

  def take_fresh(self) -> np.ndarray:
    """[slots] bool: the bank rows given to new prompts since the last call (to be emptied)."""
    fresh, self._fresh = self._fresh, np.zeros_like(self._fresh)
    return fresh

  def harvested(self, prompt: int) -> None:
    self._left[prompt] -= 1
    if not self._left[prompt]:
      self._free.append(self._row.pop(prompt))


class History:
  """Each prompt's responses in earlier rollouts, as the tokens its bank row's history holds.

  Per prompt (keyed by its tokens) at most `length` tokens: its latest rollout's responses first,
  each after the prompt's last `ngram` tokens and followed by an empty slot (-1); what does not fit
  is dropped, the oldest epochs first. Host memory: `length` int32 per prompt seen.
  """

  def __init__(self, length: int, ngram: int):
    self.length, self.ngram = length, ngram
    self._tokens: dict[tuple[int, ...], np.ndarray] = {}

  def __len__(self) -> int:
    return len(self._tokens)

  def get(self, prompt) -> np.ndarray:
    """int32 [<= length] the history of `prompt` (empty if it has none)."""
    return self._tokens.get(tuple(int(t) for t in prompt), np.zeros((0,), np.int32))

  def add(self, prompt, responses) -> None:
    """Puts one rollout's `responses` of `prompt` before its older history."""
    tail = [int(t) for t in prompt][-self.ngram:]
    new = [t for r in responses for t in (*tail, *(int(x) for x in r), -1)]
    old = self.get(prompt)
    self._tokens[tuple(int(t) for t in prompt)] = np.concatenate([np.asarray(new, np.int32), old])[:self.length]

  def state_dict(self) -> dict[str, np.ndarray]:
    """Arrays for a checkpoint: `prompts` int32 [N, P] (-1 padded), `tokens` int32 [N, length] and
    their `lengths` int32 [N]."""
    width = max([len(p) for p in self._tokens] + [1])
    prompts = np.full((len(self._tokens), width), -1, np.int32)
    tokens = np.full((len(self._tokens), self.length), -1, np.int32)
    for i, (p, h) in enumerate(self._tokens.items()):
      prompts[i, :len(p)], tokens[i, :len(h)] = p, h
    return {"prompts": prompts, "tokens": tokens, "lengths": np.asarray([len(h) for h in self._tokens.values()],
                                                                        np.int32).reshape(-1)}

  def load_state_dict(self, arrays: dict[str, np.ndarray]) -> None:
    """Restores `state_dict`'s arrays (a history of another `length` is cut to this one)."""
    self._tokens = {tuple(int(t) for t in p[p >= 0]): np.asarray(h[:min(n, self.length)], np.int32)
                    for p, h, n in zip(*(np.asarray(arrays[k]) for k in ("prompts", "tokens", "lengths")))}
