"""Tree attention as a Pallas GPU kernel on the Triton backend.

Why the Triton backend and not Mosaic GPU (both lower with JAX 0.10.2 on this CPU-only
machine): Mosaic GPU wants kernels written at the level of warpgroups, TMA copies and barriers,
for Hopper and later; the Triton backend takes generic Pallas code, runs on Ampere and later,
and the same code runs here under `interpret=True`. The backend is deprecated from JAX 0.11,
where this kernel will need a Mosaic GPU port.

Grid (row, KV head, query tile, split). A program keeps one tile of its KV head's G x T grouped
queries (at most 128 rows: a wider tile's float32 accumulator spills registers, measured on an
H200 at 256 rows) and loops over its share of the row's filled cache slots only (a dynamic trip
count), in tiles of at most 64 slots whatever the cache's block (its layout: K and V tiles of 512 x
128 bfloat16 slots overflow a Hopper SM's shared memory); the last split also folds in the window
with the tree mask. Splitting the cache (flash-decoding) keeps the GPU
busy in the long tail, where a few rows with long caches would otherwise make a few programs;
the splits' softmax states are merged outside the kernel. A program sees its KV head of the whole
cache ([L, N, P] pages) and reads block i of its row from page `pages[row, i * block // P]`; a
contiguous cache is the table with one page per row. Triton needs power-of-two shapes of
at least 16 for its matmuls: the grouped queries and the window are zero-padded to one (padded
query rows see the padded window, so no NaN), and the block and head dim must be powers of two
>= 16. Queries and a cache of different dtypes (a float32 drafter over a bfloat16 cache) score in
the wider one and weigh the values in theirs, as the reference does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from tlt_jax.kernels import layout


_TILE = 64  # cache slots per step of the walk, at most
_ROWS = 128  # grouped query rows per program, at most


def _kernel(lengths_ref, layer_ref, pages_ref, q_ref, k_ref, v_ref, kw_ref, vw_ref, mask_ref, m_ref, l_ref, acc_ref, *,
            tile, scale, page_size):
  split, splits = pl.program_id(3), pl.num_programs(3)
  length, layer = lengths_ref[0], layer_ref[0]
  q_RxD = q_ref[...]
  r, d = q_RxD.shape

  def prefix_tile(i, carry):
    start = i * tile
    page = pages_ref[jax.lax.div(start, page_size)]  # non-negative: lax.div/rem, not //, %
    at = pl.ds(pl.multiple_of(jax.lax.rem(start, page_size), tile), tile)
    s = layout.scores(q_RxD, k_ref[layer, page, at, :], scale)
    s = jnp.where((start + jnp.arange(tile))[None, :] < length, s, -jnp.inf)
    return layout.online_step(*carry, s, v_ref[layer, page, at, :])

  n_tiles = pl.cdiv(length, tile)
  per_split = pl.cdiv(n_tiles, splits)
  lo = split * per_split
  init = (jnp.full((r, 1), layout.NEG, jnp.float32), jnp.zeros((r, 1), jnp.float32), jnp.zeros((r, d), jnp.float32))
  carry = jax.lax.fori_loop(lo, jnp.minimum(lo + per_split, n_tiles), prefix_tile, init)
  # The last split also takes the window (masked out elsewhere: no branch in the kernel).
  visible = (mask_ref[...] != 0) & (split == splits - 1)
  s = jnp.where(visible, layout.scores(q_RxD, kw_ref[...], scale), -jnp.inf)
  m_ref[...], l_ref[...], acc_ref[...] = layout.online_step(*carry, s, vw_ref[...])


def tree_attention(q_BxTxHxD, k_LxNxPxKxD, v_LxNxPxKxD, layer, lengths_B, mask_BxTxW, *, block: int,
                   scale: float, interpret: bool = False, pages_BxM=None):
  """`tree_attention.reference` semantics on GPU; `interpret=True` runs it in the Pallas interpreter.
  `layer` may be traced (a scanned decoder's layer index)."""
  b, t, h, d = q_BxTxHxD.shape
  n_layers, n_pages, page_size, kv_heads, _ = k_LxNxPxKxD.shape
  w = mask_BxTxW.shape[2]
  table = layout.table(pages_BxM, b)
  row_pages = table.shape[1]
  layout.require_pow2("pallas_gpu", {"attention block": block, "head dim": d})
  tile, groups = min(block, _TILE), h // kv_heads
  r = groups * t
  rows = min(layout.pow2(r), _ROWS)
  r_pad, w_pad = -(-r // rows) * rows, layout.pow2(w)
  pad = lambda x, axis, n: jnp.pad(x, [(0, n - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)])
  dtype = jnp.promote_types(q_BxTxHxD.dtype, k_LxNxPxKxD.dtype)  # scores in the wider of the two
  q = pad(layout.group_queries(q_BxTxHxD, kv_heads).astype(dtype), 2, r_pad)
  kw = pad(layout.window(k_LxNxPxKxD, layer, lengths_B, w, pages_BxM), 2, w_pad)
  vw = pad(layout.window(v_LxNxPxKxD, layer, lengths_B, w, pages_BxM), 2, w_pad)
  mask = jnp.pad(layout.group_mask(mask_BxTxW, groups), ((0, 0), (0, r_pad - r), (0, 0)), constant_values=1)
  mask = pad(mask, 2, w_pad)

  tiles = r_pad // rows
  splits = layout.splits(page_size * row_pages // tile, b * kv_heads * tiles)
  one = lambda n: pl.BlockSpec((n,), lambda row, kh, i, split: (row,))
  queries = lambda n: pl.BlockSpec((None, None, rows, n), lambda row, kh, i, split: (row, kh, i, 0))
  window = pl.BlockSpec((None, None, w_pad, d), lambda row, kh, i, split: (row, kh, 0, 0))
  # Every layer and page of the KV head: the kernel indexes the layer and pages it reads (Triton has
  # no scalar prefetch).
  cache = pl.BlockSpec((n_layers, n_pages, page_size, None, d), lambda row, kh, i, split: (0, 0, 0, kh, 0))
  part = lambda n: pl.BlockSpec((None, None, None, rows, n), lambda row, kh, i, split: (row, kh, split, i, 0))
  part_shape = lambda n: jax.ShapeDtypeStruct((b, kv_heads, splits, r_pad, n), jnp.float32)
  m, l, acc = pl.pallas_call(
      functools.partial(_kernel, tile=tile, scale=scale, page_size=page_size),
      grid=(b, kv_heads, tiles, splits),
      in_specs=[one(1), pl.BlockSpec((1,), lambda row, kh, i, split: (0,)), one(row_pages), queries(d), cache, cache,
                window, window, pl.BlockSpec((None, rows, w_pad), lambda row, kh, i, split: (row, i, 0))],
      out_specs=[part(1), part(1), part(d)],
      out_shape=[part_shape(1), part_shape(1), part_shape(d)],
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
  )(lengths_B.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32), table.reshape(-1), q, k_LxNxPxKxD,
    v_LxNxPxKxD, kw, vw, mask)
  out = layout.merge_splits(m[..., 0], l[..., 0], acc)
  return layout.ungroup(out[:, :, :r].astype(v_LxNxPxKxD.dtype), t)
