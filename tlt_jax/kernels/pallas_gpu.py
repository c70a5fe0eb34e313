"""Tree attention as a Pallas GPU kernel on the Triton backend.

Why Triton and not Mosaic GPU (both lower with JAX 0.10.2 on a CPU-only machine): Mosaic GPU
targets Hopper and later through warpgroup/TMA primitives that have no CPU interpreter, so a
kernel written for it could not be checked here; the Triton backend runs on Ampere and later,
its kernels use only generic Pallas operations and run under `interpret=True`. It is deprecated
from JAX 0.11, where this kernel will need a Mosaic GPU port.

Grid (row, KV head). A program keeps its G x T grouped queries in registers and loops over the
row's filled cache blocks only (a dynamic trip count), then folds in the window with the tree
mask. Triton needs power-of-two shapes of at least 16 for its matmuls: the grouped queries and
the window are zero-padded to one (padded query rows see the padded window, so no NaN), and the
block and head dim must be powers of two >= 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from tlt_jax.kernels import layout


def _kernel(lengths_ref, q_ref, k_ref, v_ref, kw_ref, vw_ref, mask_ref, o_ref, *, block, scale):
  length = lengths_ref[0]
  q_RxD = q_ref[...]
  r, d = q_RxD.shape

  def prefix_block(i, carry):
    start = pl.multiple_of(i * block, block)
    s = layout.scores(q_RxD, k_ref[pl.ds(start, block), :], scale)
    s = jnp.where((start + jnp.arange(block))[None, :] < length, s, -jnp.inf)
    return layout.online_step(*carry, s, v_ref[pl.ds(start, block), :])

  init = (jnp.full((r, 1), layout.NEG, jnp.float32), jnp.zeros((r, 1), jnp.float32), jnp.zeros((r, d), jnp.float32))
  carry = jax.lax.fori_loop(0, pl.cdiv(length, block), prefix_block, init)
  s = jnp.where(mask_ref[...] != 0, layout.scores(q_RxD, kw_ref[...], scale), -jnp.inf)
  _, l, acc = layout.online_step(*carry, s, vw_ref[...])
  o_ref[...] = (acc / l).astype(o_ref.dtype)


def _pow2(n: int) -> int:
  return max(16, 1 << (n - 1).bit_length())


def tree_attention(q_BxTxHxD, k_LxBxSxKxD, v_LxBxSxKxD, layer: int, lengths_B, mask_BxTxW, *, block: int,
                   scale: float, interpret: bool = False):
  """`tree_attention.reference` semantics on GPU; `interpret=True` runs it in the Pallas interpreter."""
  b, t, h, d = q_BxTxHxD.shape
  kv_heads, w = k_LxBxSxKxD.shape[3], mask_BxTxW.shape[2]
  for name, n in (("attention block", block), ("head dim", d)):
    if n < 16 or n & (n - 1):
      raise ValueError(f"pallas_gpu needs a power-of-two {name} >= 16, got {n}")
  groups = h // kv_heads
  r, r_pad, w_pad = groups * t, _pow2(groups * t), _pow2(w)
  pad = lambda x, axis, n: jnp.pad(x, [(0, n - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)])
  q = pad(layout.group_queries(q_BxTxHxD, kv_heads), 2, r_pad)
  kw = pad(layout.window(k_LxBxSxKxD, layer, lengths_B, w), 2, w_pad)
  vw = pad(layout.window(v_LxBxSxKxD, layer, lengths_B, w), 2, w_pad)
  mask = jnp.pad(layout.group_mask(mask_BxTxW, groups), ((0, 0), (0, r_pad - r), (0, 0)), constant_values=1)
  mask = pad(mask, 2, w_pad)

  rows = lambda n: pl.BlockSpec((None, None, n, d), lambda row, kh: (row, kh, 0, 0))
  cache = pl.BlockSpec((None, None, k_LxBxSxKxD.shape[2], None, d), lambda row, kh: (layer, row, 0, kh, 0))
  out = pl.pallas_call(
      functools.partial(_kernel, block=block, scale=scale),
      grid=(b, kv_heads),
      in_specs=[pl.BlockSpec((1,), lambda row, kh: (row,)), rows(r_pad), cache, cache, rows(w_pad), rows(w_pad),
                pl.BlockSpec((None, r_pad, w_pad), lambda row, kh: (row, 0, 0))],
      out_specs=rows(r_pad),
      out_shape=jax.ShapeDtypeStruct((b, kv_heads, r_pad, d), q_BxTxHxD.dtype),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
  )(lengths_B.astype(jnp.int32), q, k_LxBxSxKxD, v_LxBxSxKxD, kw, vw, mask)
  return layout.ungroup(out[:, :, :r], t)
