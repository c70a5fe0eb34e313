"""What the tree-attention tests share: brute-force attention, the cases every implementation is
checked on, and a paged copy of a contiguous cache."""

import jax.numpy as jnp
import numpy as np


def brute_force(q, k, v, lengths, mask):
  """Attention by its definition, query by query, in float64: q [B,T,H,D], k/v [B,S,K,D]."""
  b, t, h, d = q.shape
  groups = h // k.shape[2]
  out = np.zeros(q.shape)
  for r in range(b):
    for i in range(t):
      keys = list(range(lengths[r])) + [lengths[r] + j for j in range(mask.shape[2]) if mask[r, i, j]]
      k_NxHxD, v_NxHxD = (np.repeat(np.float64(x[r, keys]), groups, axis=1) for x in (k, v))
      s = np.einsum("hd,nhd->hn", np.float64(q[r, i]), k_NxHxD) / np.sqrt(d)
      p = np.exp(s - s.max(axis=1, keepdims=True))
      out[r, i] = np.einsum("hn,nhd->hd", p / p.sum(axis=1, keepdims=True), v_NxHxD)
  return out


# ---- every implementation against the reference: one shared test base ----
# The grid's axes (GQA ratio, head dim, tree size V, earlier window slots, dtype) are covered
# case by case rather than crossed: interpret mode is slow. Every case has ragged rows, one of
# length 0 and one filled to the cache's end.
CASES = [  # (groups, head_dim, V, earlier, dtype)
    (1, 64, 1, 0, "float32"),  # decode
    (4, 128, 5, 3, "float32"),  # a drafter level after 3 earlier tree tokens
    (8, 64, 64, 0, "bfloat16"),
    (1, 128, 7, 0, "bfloat16"),
    (8, 128, 1, 2, "bfloat16"),
]
KV_HEADS, BLOCK, CAPACITY = 2, 16, 112


def case_inputs(groups, d, t, earlier, dtype):
  rng = np.random.RandomState(groups * d + t)
  w = earlier + t
  lengths = np.asarray([0, 5, 37, CAPACITY - w], np.int32)
  b = len(lengths)
  mask = rng.rand(b, t, w) < 0.5
  mask[:, :, earlier:] |= np.eye(t, dtype=bool)
  mask[:, :, earlier:] &= np.tril(np.ones((t, t), bool))  # a tree: nothing after itself
  cast = lambda x: jnp.asarray(x, dtype)
  q = cast(rng.randn(b, t, KV_HEADS * groups, d))
  k, v = (cast(rng.randn(2, b, CAPACITY, KV_HEADS, d)) for _ in range(2))
  return q, k, v, lengths, mask


def paged(k, v, lengths, w, page, seed=0, shards=1):
  """The same rows in a shuffled pool of `page`-slot pages (plus spare pages), and their tables; a
  row's pages past its filled length + window are not held (entry N). `shards`: the pool split
  into that many equal ranges, each holding the pages of its share of the rows (in order), as
  the engine places a paged cache's rows on a mesh."""
  rng = np.random.RandomState(seed)
  layers, b, cap, kv, d = k.shape
  m, rows = cap // page, b // shards
  per = rows * m + 3  # a shard's pages
  n = shards * per
  order = np.concatenate([s * per + rng.permutation(per)[:rows * m] for s in range(shards)]).reshape(b, m)
  pool = lambda x: jnp.zeros((layers, n, page, kv, d), x.dtype).at[:, order.reshape(-1)].set(
      x.reshape(layers, b * m, page, kv, d))
  held = np.arange(m)[None] * page < (np.asarray(lengths) + w)[:, None]
  return pool(k), pool(v), jnp.asarray(np.where(held, order, n), jnp.int32)


PAGE = 16
