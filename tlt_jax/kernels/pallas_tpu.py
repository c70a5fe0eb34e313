"""Tree attention as a Pallas TPU (Mosaic) kernel.

Grid (row, cache block). A row's queries (all heads) stay in VMEM while its cache blocks stream
through; the running softmax state lives in VMEM scratch. The rows' lengths are prefetched
into SMEM so that the block index map clamps to the row's last filled block: blocks past the
filled length are neither copied (Pallas skips the DMA when the block index repeats) nor
computed, so the cost tracks the filled length, not the cache capacity. The window (W slots
with the tree mask) is folded in at the last grid step. The cache is read as [L, B, S, K*D]
(a free reshape) so a block's last two dimensions are (block, K*D) and satisfy Mosaic's tiling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tlt_jax.kernels import layout


def _kernel(lengths_ref, q_ref, k_ref, v_ref, kw_ref, vw_ref, mask_ref, o_ref, m_ref, l_ref, acc_ref, *,
            block, kv_heads, head_dim, scale):
  b, i = pl.program_id(0), pl.program_id(1)
  length = lengths_ref[b]

  @pl.when(i == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, layout.NEG, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def fold(h, s_RxC, v_CxD):
    m, l, acc = layout.online_step(m_ref[h], l_ref[h], acc_ref[h], s_RxC, v_CxD)
    m_ref[h], l_ref[h], acc_ref[h] = m, l, acc

  @pl.when(i * block < length)
  def _prefix():
    slot_1xC = i * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
    for h in range(kv_heads):  # static: each KV head is a lane-aligned column range of the block
      cols = pl.ds(h * head_dim, head_dim)
      s = layout.scores(q_ref[h], k_ref[:, cols], scale)
      fold(h, jnp.where(slot_1xC < length, s, -jnp.inf), v_ref[:, cols])

  @pl.when(i == pl.num_programs(1) - 1)
  def _window_and_write():
    f32 = lambda x: x.astype(jnp.float32)  # a few slots; Mosaic rejects bf16 matmuls with one (decode)
    for h in range(kv_heads):
      s = layout.scores(f32(q_ref[h]), f32(kw_ref[h]), scale)
      fold(h, jnp.where(mask_ref[...] != 0, s, -jnp.inf), f32(vw_ref[h]))
      o_ref[h] = (acc_ref[h] / l_ref[h]).astype(o_ref.dtype)


def tree_attention(q_BxTxHxD, k_LxBxSxKxD, v_LxBxSxKxD, layer: int, lengths_B, mask_BxTxW, *, block: int,
                   scale: float, interpret: bool = False):
  """`tree_attention.reference` semantics on TPU; `interpret=True` runs the TPU interpreter (CPU)."""
  b, t, h, d = q_BxTxHxD.shape
  n_layers, _, s_cap, kv_heads, _ = k_LxBxSxKxD.shape
  w, groups = mask_BxTxW.shape[2], h // kv_heads
  r = groups * t
  lengths_B = lengths_B.astype(jnp.int32)
  flat = lambda c: c.reshape(n_layers, b, s_cap, kv_heads * d)

  def cache_block(row, i, lengths):  # past the row's last filled block: repeat it (no DMA)
    last = jnp.maximum(pl.cdiv(lengths[row], block) - 1, 0)
    return layer, row, jnp.minimum(i, last), 0

  per_row = lambda shape: pl.BlockSpec((None, *shape), lambda row, i, lengths: (row,) + (0,) * len(shape))
  cache_spec = pl.BlockSpec((None, None, block, kv_heads * d), cache_block)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(b, s_cap // block),
      in_specs=[per_row((kv_heads, r, d)), cache_spec, cache_spec, per_row((kv_heads, w, d)),
                per_row((kv_heads, w, d)), per_row((r, w))],
      out_specs=per_row((kv_heads, r, d)),
      scratch_shapes=[pltpu.VMEM((kv_heads, r, 1), jnp.float32), pltpu.VMEM((kv_heads, r, 1), jnp.float32),
                      pltpu.VMEM((kv_heads, r, d), jnp.float32)])
  kernel = functools.partial(_kernel, block=block, kv_heads=kv_heads, head_dim=d, scale=scale)
  out = pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((b, kv_heads, r, d), q_BxTxHxD.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
  )(lengths_B, layout.group_queries(q_BxTxHxD, kv_heads), flat(k_LxBxSxKxD), flat(v_LxBxSxKxD),
    layout.window(k_LxBxSxKxD, layer, lengths_B, w), layout.window(v_LxBxSxKxD, layer, lengths_B, w),
    layout.group_mask(mask_BxTxW, groups))
  return layout.ungroup(out, t)
