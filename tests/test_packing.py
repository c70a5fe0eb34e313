"""Packing (prompt, response) sequences into rows: layout, truncation or dropping, isolation masks."""

import numpy as np
import pytest

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


def test_overlong_sequences_can_be_dropped():
  rows = packing.pack([([1, 2], [3]), ([4] * 6, [5] * 6)], 8, truncate=False)
  assert rows.shape == (4, 1, 8)
  np.testing.assert_array_equal(rows[0, 0], [1, 2, 3, 0, 0, 0, 0, 0])


def test_segment_mask_is_causal_within_samples():
  mask = np.asarray(packing.segment_mask(np.asarray([[1, 1, 2, 2, 0]])))[0]
  expected = np.asarray([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]], bool)
  np.testing.assert_array_equal(mask, expected)
