"""Packing variable-length (prompt, response) sequences into fixed-shape rows, samples kept apart.

Used by SFT and drafter distillation: positions restart per sample and `segment_mask` lets a
token attend only within its own sample, so packed samples never see each other.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

# (prompt_ids, response_ids) or (prompt_ids, response_ids, trained): `trained` (one per response token,
# e.g. False on a tool turn's tokens) masks the loss within the response.
Sequences = Sequence[tuple[Sequence[int], Sequence[int]] | tuple[Sequence[int], Sequence[int], Sequence[bool]]]


def pack(sequences: Sequences, row_len: int, truncate: bool = True, index: bool = False) -> np.ndarray:
  """Packs sequences into rows (first fit, longest first): [4, rows, row_len] int32.

  The four planes are tokens, positions (restarting per sample), segment ids (1, 2, ... per row;
  0 is padding) and the loss mask (1 on response tokens, but those a sequence's `trained` mask is
  False on); with `index` a fifth plane holds each
  slot's sequence index + 1 (0 on padding), to scatter per-sequence values (RL advantages).
  Sequences longer than `row_len` are truncated (`truncate`, e.g. drafter data: every pair counts)
  or dropped (SFT: a cut solution would teach the policy never to finish); those without a
  response token left are dropped.
  """
  if row_len < 2:
    raise ValueError(f"row_len must be at least 2, got {row_len}")
  items, overlong, dropped = [], 0, 0
  for number, (prompt, response, *trained) in enumerate(sequences, 1):
    seq = (list(prompt) + list(response))[:row_len]
    overlong += len(prompt) + len(response) > row_len
    if len(seq) <= len(prompt) or (not truncate and len(prompt) + len(response) > row_len):
      dropped += 1
      continue
    mask = np.ones((len(response),), np.int32) if not trained else np.asarray(trained[0], np.int32)
    items.append((seq, len(prompt), number, mask))
  if overlong:
    logging.warning("packing: %d of %d sequences are longer than row_len=%d (%d dropped, the rest truncated)",
                    overlong, len(sequences), row_len, dropped)
  if not items:
    raise ValueError(f"no sequence has a response token within row_len={row_len}")
  rows, free = [], []
  for seq, prompt_len, number, mask in sorted(items, key=lambda x: -len(x[0])):
    r = next((i for i, room in enumerate(free) if room >= len(seq)), None)
    if r is None:
      rows.append([])
      free.append(row_len)
      r = len(rows) - 1
    rows[r].append((seq, prompt_len, number, mask))
    free[r] -= len(seq)
  out = np.zeros((5 if index else 4, len(rows), row_len), np.int32)
  for r, samples in enumerate(rows):
    at = 0
    for seg, (seq, prompt_len, number, mask) in enumerate(samples, 1):
      n = len(seq)
      out[0, r, at:at + n] = seq
      out[1, r, at:at + n] = np.arange(n)
      out[2, r, at:at + n] = seg
      out[3, r, at + prompt_len:at + n] = mask[:n - prompt_len]
      if index:
        out[4, r, at:at + n] = number
      at += n
  return out


def segment_mask(segments_BxT: jax.Array) -> jax.Array:
  """[B, T, T] attention mask: causal within a segment; every slot sees itself (padding too)."""
  t = segments_BxT.shape[1]
  same = segments_BxT[:, :, None] == segments_BxT[:, None, :]
  return same & jnp.tril(jnp.ones((t, t), bool)) | jnp.eye(t, dtype=bool)
