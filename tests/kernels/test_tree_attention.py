"""The tree-attention reference against a brute-force NumPy attention, dense and blockwise."""

import numpy as np
import pytest

from tlt_jax.kernels import tree_attention


def brute_force(q, k, v, lengths, mask):
  b, t, h, d = q.shape
  groups = h // k.shape[2]
  out = np.zeros_like(q)
  for r in range(b):
    for i in range(t):
      keys = list(range(lengths[r])) + [lengths[r] + j for j in range(mask.shape[2]) if mask[r, i, j]]
      for head in range(h):
        s = np.asarray([q[r, i, head] @ k[r, j, head // groups] for j in keys]) / np.sqrt(d)
        p = np.exp(s - s.max())
        out[r, i, head] = (p / p.sum()) @ v[r, keys, head // groups]
  return out


@pytest.mark.parametrize("block", [None, 4, 8])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("earlier", [0, 3])  # tree tokens of earlier calls before the new ones
def test_matches_brute_force(block, groups, earlier):
  rng = np.random.RandomState(groups)
  b, t, kv, d, cap = 3, 5, 2, 8, 24
  lengths = np.asarray([0, 4, 11], np.int32)
  mask = rng.rand(b, t, earlier + t) < 0.5
  mask[:, :, earlier:] |= np.eye(t, dtype=bool)  # every query sees itself
  q = rng.randn(b, t, kv * groups, d).astype(np.float32)
  k = rng.randn(1, b, cap, kv, d).astype(np.float32)
  v = rng.randn(1, b, cap, kv, d).astype(np.float32)
  got = tree_attention.reference(q, k, v, 0, lengths, mask, block=block)
  np.testing.assert_allclose(got, brute_force(q, k[0], v[0], lengths, mask), atol=1e-5)


def test_capacity_must_be_a_multiple_of_the_block():
  x = np.zeros((1, 1, 1, 4), np.float32)
  with pytest.raises(ValueError, match="capacity 6 is not a multiple of the attention block 4"):
    tree_attention.reference(x, np.zeros((1, 1, 6, 1, 4), np.float32), np.zeros((1, 1, 6, 1, 4), np.float32), 0,
                             np.zeros(1, np.int32), np.ones((1, 1, 1), bool), block=4)
