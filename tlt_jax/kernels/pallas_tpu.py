"""Tree attention as a Pallas TPU (Mosaic) kernel.

Grid (row,). A row's queries (all heads) stay in VMEM; the kernel itself streams the row's
filled cache blocks from HBM with double-buffered DMAs (the next block's copy runs while the
current one is computed), in a loop whose trip count is the row's own filled length (lengths
are prefetched into SMEM, with the layer index: a run-time value, so one kernel serves every
layer of a scanned decoder). Nothing past the filled length is copied or visited, so the cost
tracks the filled length, not the cache capacity, whatever the block size. The running softmax
state lives in VMEM scratch; the window (W slots with the tree mask) is folded in last. The
cache is read as [L, B, S, K*D] (a free reshape), so a block is one contiguous (block, K*D)
copy and each KV head a lane-aligned column range of it. A paged cache ([L, N, P, K*D] pages)
takes its page table as a third prefetched scalar operand: block i of row b is copied from page
`pages[b, i * block // P]`; a contiguous cache is the table with one page per row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tlt_jax.kernels import layout


def _kernel(lengths_ref, layer_ref, pages_ref, q_ref, k_hbm, v_hbm, kw_ref, vw_ref, mask_ref, o_ref, k_buf, v_buf, sems,
            m_ref, l_ref, acc_ref, *, block, kv_heads, head_dim, scale, page_size, row_pages):
  b, layer = pl.program_id(0), layer_ref[0]
  length = lengths_ref[b]
  n_blocks = pl.cdiv(length, block)
  m_ref[...] = jnp.full(m_ref.shape, layout.NEG, jnp.float32)
  l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
  acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def copies(i, slot):
    start = i * block
    page = pages_ref[b * row_pages + jax.lax.div(start, page_size)]  # non-negative: lax.div/rem, not //, %
    at = pl.ds(pl.multiple_of(jax.lax.rem(start, page_size), block), block)
    return (pltpu.make_async_copy(k_hbm.at[layer, page, at], k_buf.at[slot], sems.at[0, slot]),
            pltpu.make_async_copy(v_hbm.at[layer, page, at], v_buf.at[slot], sems.at[1, slot]))

  def fold(h, s_RxC, v_CxD):
    m, l, acc = layout.online_step(m_ref[h], l_ref[h], acc_ref[h], s_RxC, v_CxD)
    m_ref[h], l_ref[h], acc_ref[h] = m, l, acc

  @pl.when(n_blocks > 0)
  def _first():
    for c in copies(0, 0):
      c.start()

  def prefix_block(i, carry):
    slot = i % 2

    @pl.when(i + 1 < n_blocks)
    def _prefetch():
      for c in copies(i + 1, 1 - slot):
        c.start()

    for c in copies(i, slot):
      c.wait()
    slot_1xC = i * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
    for h in range(kv_heads):  # static
      cols = pl.ds(h * head_dim, head_dim)
      s = layout.scores(q_ref[h], k_buf[slot, :, cols], scale)
      fold(h, jnp.where(slot_1xC < length, s, -jnp.inf), v_buf[slot, :, cols])
    return carry

  jax.lax.fori_loop(0, n_blocks, prefix_block, 0)
  f32 = lambda x: x.astype(jnp.float32)  # a few slots; Mosaic rejects bf16 matmuls with one (decode)
  for h in range(kv_heads):
    s = layout.scores(f32(q_ref[h]), f32(kw_ref[h]), scale)
    fold(h, jnp.where(mask_ref[...] != 0, s, -jnp.inf), f32(vw_ref[h]))
    o_ref[h] = (acc_ref[h] / l_ref[h]).astype(o_ref.dtype)


def tree_attention(q_BxTxHxD, k_LxNxPxKxD, v_LxNxPxKxD, layer, lengths_B, mask_BxTxW, *, block: int,
                   scale: float, interpret: bool = False, pages_BxM=None):
  """`tree_attention.reference` semantics on TPU; `interpret=True` runs the TPU interpreter (CPU).
  `layer` may be traced (a scanned decoder's layer index)."""
  b, t, h, d = q_BxTxHxD.shape
  n_layers, n_pages, page_size, kv_heads, _ = k_LxNxPxKxD.shape
  w, groups = mask_BxTxW.shape[2], h // kv_heads
  r, dtype = groups * t, k_LxNxPxKxD.dtype
  table = layout.table(pages_BxM, b)
  tile = 32 // dtype.itemsize  # rows of a (sublane) tile: 8 for float32, 16 for bfloat16
  if block % tile:
    raise ValueError(f"pallas_tpu needs an attention block that is a multiple of {tile} for {dtype}, got {block}")
  flat = lambda c: c.reshape(n_layers, n_pages, page_size, kv_heads * d)
  per_row = lambda shape: pl.BlockSpec((None, *shape), lambda row, *prefetched: (row,) + (0,) * len(shape))
  hbm = pl.BlockSpec(memory_space=pl.ANY)  # the caches stay in HBM; the kernel copies what it reads
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3, grid=(b,),
      in_specs=[per_row((kv_heads, r, d)), hbm, hbm, per_row((kv_heads, w, d)), per_row((kv_heads, w, d)),
                per_row((r, w))],
      out_specs=per_row((kv_heads, r, d)),
      scratch_shapes=[pltpu.VMEM((2, block, kv_heads * d), dtype), pltpu.VMEM((2, block, kv_heads * d), dtype),
                      pltpu.SemaphoreType.DMA((2, 2)), pltpu.VMEM((kv_heads, r, 1), jnp.float32),
                      pltpu.VMEM((kv_heads, r, 1), jnp.float32), pltpu.VMEM((kv_heads, r, d), jnp.float32)])
  kernel = functools.partial(_kernel, block=block, kv_heads=kv_heads, head_dim=d, scale=scale, page_size=page_size,
                             row_pages=table.shape[1])
  out = pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((b, kv_heads, r, d), v_LxNxPxKxD.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=pltpu.InterpretParams() if interpret else False,
  )(lengths_B.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32), table.reshape(-1),
    layout.group_queries(q_BxTxHxD, kv_heads).astype(jnp.promote_types(q_BxTxHxD.dtype, dtype)), flat(k_LxNxPxKxD),
    flat(v_LxNxPxKxD),
    layout.window(k_LxNxPxKxD, layer, lengths_B, w, pages_BxM),
    layout.window(v_LxNxPxKxD, layer, lengths_B, w, pages_BxM),
    layout.group_mask(mask_BxTxW, groups))
  return layout.ungroup(out, t)
