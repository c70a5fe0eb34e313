"""What the tree-attention implementations share: the cache's layout, the kernels' input layout
and the online-softmax step.

A cache holds [L, N, P, K, D] keys (and values): N pages of P slots. Contiguous (no page table),
page b is row b's whole cache (N = B rows, P = capacity). Paged, row b's slot s lives in page
`pages_BxM[b, s // P]` at offset `s % P`; a row's M pages cover its capacity M x P, and an entry
of N (one past the pool) marks a page the row does not hold: writes there are dropped.

The kernels split each row's keys into the prefix (slots `< lengths[b]`, visible to every query:
only a length test, walked block by block) and the window of W slots after it (gathered here,
a few slots per row, with the tree mask). Queries are grouped per KV head as R = G x T rows
(g-major), so one matmul serves all G query heads of a KV head (GQA). The GPU kernels (Triton
code, through Pallas or `jax_triton`) split each row's walk over the cache (flash-decoding) and
merge the splits' softmax states here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG = -1e30  # finite "minus infinity" for the running max: fully masked blocks give no NaN


def group_queries(q_BxTxHxD, kv_heads: int):
  """[B, K, G*T, D]: row g*T + t of KV head k is query head k*G + g at token t."""
  b, t, h, d = q_BxTxHxD.shape
  q = q_BxTxHxD.reshape(b, t, kv_heads, h // kv_heads, d)
  return q.transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, h // kv_heads * t, d)


def ungroup(out_BxKxRxD, t: int):
  """Inverse of `group_queries`: [B, T, H, D]."""
  b, k, r, d = out_BxKxRxD.shape
  return out_BxKxRxD.reshape(b, k, r // t, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, k * (r // t), d)


def table(pages_BxM, rows: int):
  """[B, M] int32 page table: `pages_BxM`, or for a contiguous cache (None) one page per row."""
  return jnp.arange(rows, dtype=jnp.int32)[:, None] if pages_BxM is None else pages_BxM.astype(jnp.int32)


def address(pages_BxM, slots_BxT, page_size: int, num_pages: int):
  """(page, offset) [B, T] of each row's slots: the row itself and the slot without a page table;
  slots past a row's table get page `num_pages` (out of the pool: writes there are dropped)."""
  if pages_BxM is None:
    return jnp.broadcast_to(jnp.arange(slots_BxT.shape[0])[:, None], slots_BxT.shape), slots_BxT
  page = jnp.take_along_axis(pages_BxM, slots_BxT // page_size, axis=1, mode="fill", fill_value=num_pages)
  return page, slots_BxT % page_size


def capacity(cache_LxNxPxKxD, pages_BxM) -> int:
  """Slots per row: the page (contiguous) or the pages of a row's table."""
  return cache_LxNxPxKxD.shape[2] * (1 if pages_BxM is None else pages_BxM.shape[1])


def block(cache_LxNxPxKxD, layer, pages_BxM, start, size: int, rows: int):
  """[B, size, K, D]: slots start .. start + size - 1 of every row (`size` divides the page size;
  `start` a multiple of it, may be traced), without copying the layer's cache."""
  _, _, p, k, d = cache_LxNxPxKxD.shape
  if pages_BxM is None:
    return jax.lax.dynamic_slice(cache_LxNxPxKxD, (layer, 0, start, 0, 0), (1, rows, size, k, d))[0]
  page_B = jax.lax.dynamic_index_in_dim(pages_BxM, start // p, axis=1, keepdims=False)
  page_B = jnp.minimum(page_B, cache_LxNxPxKxD.shape[1] - 1)  # a page not held: garbage past the length
  one = lambda page: jax.lax.dynamic_slice(cache_LxNxPxKxD, (layer, page, start % p, 0, 0), (1, 1, size, k, d))[0, 0]
  return jax.vmap(one)(page_B)


def rows(cache_LxNxPxKxD, layer, pages_BxM):
  """[B, capacity, K, D]: every row's whole cache of layer `layer` (the dense path)."""
  if pages_BxM is None:
    return cache_LxNxPxKxD[layer]
  b, m = pages_BxM.shape
  out = jnp.take(cache_LxNxPxKxD[layer], pages_BxM, axis=0, mode="clip")  # [B, M, P, K, D]
  return out.reshape(b, m * out.shape[2], *out.shape[3:])


def window(cache_LxNxPxKxD, layer, lengths_B, w: int, pages_BxM=None):
  """[B, K, W, D]: each row's W window slots, gathered without copying the layer's cache."""
  slots_BxW = lengths_B[:, None] + jnp.arange(w)[None, :]
  page, offset = address(pages_BxM, slots_BxW, cache_LxNxPxKxD.shape[2], cache_LxNxPxKxD.shape[1])
  return cache_LxNxPxKxD.at[layer, page, offset].get(mode="clip").transpose(0, 2, 1, 3)


def group_mask(mask_BxTxW, groups: int):
  """[B, G*T, W] int32 (Pallas refs hold no bools): the tree mask for every grouped query row."""
  return jnp.tile(mask_BxTxW, (1, groups, 1)).astype(jnp.int32)


def scores(q_RxD, k_CxD, scale: float):
  """q k^T in float32, scaled: [R, C]; the keys in the queries' dtype (the wider of the two: the
  kernels promote the queries), as Triton multiplies only operands of one dtype."""
  s = jax.lax.dot_general(q_RxD, k_CxD.astype(q_RxD.dtype), (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32)
  return s * scale


def online_step(m_Rx1, l_Rx1, acc_RxD, s_RxC, v_CxD):
  """Folds one block of (masked, -inf) scores and its values into the running softmax state."""
  m_new = jnp.maximum(m_Rx1, jnp.max(s_RxC, axis=1, keepdims=True))
  p = jnp.exp(s_RxC - m_new)
  rescale = jnp.exp(m_Rx1 - m_new)
  l_new = l_Rx1 * rescale + jnp.sum(p, axis=1, keepdims=True)
  pv = jax.lax.dot_general(p.astype(v_CxD.dtype), v_CxD, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)
  return m_new, l_new, acc_RxD * rescale + pv


# ---- the GPU kernels (Triton) ----
SPLIT_PROGRAMS = 256  # programs a GPU kernel aims for: about two per SM of an H100 (132 SMs)


def pow2(n: int) -> int:
  """The least power of two >= n and >= 16 (Triton's least matmul dimension)."""
  return max(16, 1 << (n - 1).bit_length())


def require_pow2(impl: str, sizes: dict[str, int]):
  """Triton's block shapes are powers of two, its matmuls at least 16 wide."""
  for name, n in sizes.items():
    if n < 16 or n & (n - 1):
      raise ValueError(f"{impl} needs a power-of-two {name} >= 16, got {n}")


def splits(blocks: int, programs: int) -> int:
  """Splits of each program's walk over a row's `blocks` cache blocks (flash-decoding): enough for
  about SPLIT_PROGRAMS programs in all, so a few long rows still fill the GPU; at least one."""
  return max(1, min(blocks, SPLIT_PROGRAMS // programs))


def merge_splits(m_BxKxSxR, l_BxKxSxR, acc_BxKxSxRxD):
  """[B, K, R, D] float32 attention from the splits' running softmax states (axis 2); an empty
  split carries m = NEG and weighs nothing."""
  weight = jnp.exp(m_BxKxSxR - m_BxKxSxR.max(axis=2, keepdims=True))
  return (acc_BxKxSxRxD * weight[..., None]).sum(axis=2) / (l_BxKxSxR * weight).sum(axis=2)[..., None]
