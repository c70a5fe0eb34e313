"""Packing (prompt, response) sequences into rows: layout, truncation or dropping, isolation masks."""

import re

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tlt_jax import packing


def test_pack_layout():
  rows = packing.pack([([5, 6], [7, 8, 9]), ([1, 2, 3], [4]), ([9] * 7, [8] * 5)], 10)
  tokens, positions, segments, loss_mask = rows
  assert rows.shape == (4, 2, 10)
  # Longest first; the 12-token sequence is truncated to its first 10 tokens.
  np.testing.assert_array_equal(tokens[0], [9] * 7 + [8] * 3)
  np.testing.assert_array_equal(loss_mask[0], [0] * 7 + [1] * 3)
  np.testing.assert_array_equal(tokens[1], [5, 6, 7, 8, 9, 1, 2, 3, 4, 0])
  np.testing.assert_array_equal(positions[1], [0, 1, 2, 3, 4, 0, 1, 2, 3, 0])
  np.testing.assert_array_equal(segments[1], [1, 1, 1, 1, 1, 2, 2, 2, 2, 0])
  np.testing.assert_array_equal(loss_mask[1], [0, 0, 1, 1, 1, 0, 0, 0, 1, 0])
  with pytest.raises(ValueError, match="row_len=3"):
    packing.pack([([1, 2, 3], [4])], 3)


def test_index_plane_names_each_slots_sequence():
  rows = packing.pack([([5, 6], [7, 8, 9]), ([1, 2, 3], [4]), ([9] * 7, [8] * 5)], 10, index=True)
  assert rows.shape == (5, 2, 10)
  np.testing.assert_array_equal(rows[4, 0], [3] * 10)
  np.testing.assert_array_equal(rows[4, 1], [1] * 5 + [2] * 4 + [0])
  dropped = packing.pack([([4] * 6, [5] * 6), ([1, 2], [3])], 8, truncate=False, index=True)
  np.testing.assert_array_equal(dropped[4, 0], [2, 2, 2, 0, 0, 0, 0, 0])  # numbers survive a drop


def test_a_trained_mask_leaves_tokens_out_of_the_loss():
  """Tool turns' tokens (False in a sequence's mask) are in the row but out of the loss mask."""
  rows = packing.pack([([1, 2], [3, 4, 5, 6], [True, False, False, True]), ([7], [8, 9])], 9)
  np.testing.assert_array_equal(rows[0, 0], [1, 2, 3, 4, 5, 6, 7, 8, 9])
  np.testing.assert_array_equal(rows[3, 0], [0, 0, 1, 0, 0, 1, 0, 1, 1])


def test_overlong_sequences_can_be_dropped():
  rows = packing.pack([([1, 2], [3]), ([4] * 6, [5] * 6)], 8, truncate=False)
  assert rows.shape == (4, 1, 8)
  np.testing.assert_array_equal(rows[0, 0], [1, 2, 3, 0, 0, 0, 0, 0])


def test_segment_mask_is_causal_within_samples():
  mask = np.asarray(packing.segment_mask(np.asarray([[1, 1, 2, 2, 0]])))[0]
  expected = np.asarray([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]], bool)
  np.testing.assert_array_equal(mask, expected)


# ---- property-based: random sequences and row lengths ----

token_lists = lambda max_size: st.lists(st.integers(1, 50_000), max_size=max_size)


@settings(max_examples=150)
@given(st.lists(st.tuples(token_lists(12), token_lists(12)), min_size=1, max_size=12), st.integers(-1, 24),
       st.booleans())
def test_fuzz_every_token_lands_once_in_its_own_segment(sequences, row_len, truncate):
  if row_len < 2:
    with pytest.raises(ValueError, match=f"row_len must be at least 2, got {row_len}"):
      packing.pack(sequences, row_len, truncate)
    event("rejected: row_len < 2")
    return
  kept = {number: (p + r)[:row_len] for number, (p, r) in enumerate(sequences, 1)
          if len(p) < row_len and r and (truncate or len(p) + len(r) <= row_len)}
  if not kept:
    with pytest.raises(ValueError, match=re.escape(f"row_len={row_len}")):
      packing.pack(sequences, row_len, truncate, index=True)
    event("rejected: nothing fits")
    return
  tokens, positions, segments, loss_mask, index = packing.pack(sequences, row_len, truncate, index=True)
  found = {}
  for r in range(tokens.shape[0]):
    assert (np.diff(segments[r][segments[r] > 0]) >= 0).all() and (segments[r] > 0).any()  # no empty rows
    for seg in np.unique(segments[r][segments[r] > 0]):
      slots = np.flatnonzero(segments[r] == seg)
      np.testing.assert_array_equal(slots, slots[0] + np.arange(len(slots)))  # contiguous: segments never mix
      number = index[r, slots[0]]
      assert (index[r, slots] == number).all() and number not in found  # one sequence, placed once
      found[number] = tokens[r, slots].tolist()
      np.testing.assert_array_equal(positions[r, slots], np.arange(len(slots)))  # positions restart
      prompt_len = len(sequences[number - 1][0])
      np.testing.assert_array_equal(loss_mask[r, slots], np.arange(len(slots)) >= prompt_len)
    pad = segments[r] == 0
    assert not (tokens[r, pad].any() or positions[r, pad].any() or loss_mask[r, pad].any() or index[r, pad].any())
  assert found == kept
  event("packed, some dropped" if len(kept) < len(sequences) else "packed, all kept")
