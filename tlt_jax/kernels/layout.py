"""What the fused tree-attention kernels share: their input layout and the online-softmax step.

The kernels split each row's keys into the prefix (slots `< lengths[b]`, visible to every query:
only a length test, walked block by block) and the window of W slots after it (gathered here,
a few slots per row, with the tree mask). Queries are grouped per KV head as R = G x T rows
(g-major), so one matmul serves all G query heads of a KV head (GQA).
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


def window(cache_LxBxSxKxD, layer, lengths_B, w: int):
  """[B, K, W, D]: each row's W window slots, gathered without copying the layer's cache."""
  b = lengths_B.shape[0]
  slots_BxW = lengths_B[:, None] + jnp.arange(w)[None, :]
  return cache_LxBxSxKxD[layer, jnp.arange(b)[:, None], slots_BxW].transpose(0, 2, 1, 3)


def group_mask(mask_BxTxW, groups: int):
  """[B, G*T, W] int32 (Pallas refs hold no bools): the tree mask for every grouped query row."""
  return jnp.tile(mask_BxTxW, (1, groups, 1)).astype(jnp.int32)


def scores(q_RxD, k_CxD, scale: float):
  """q k^T in float32, scaled: [R, C]."""
  s = jax.lax.dot_general(q_RxD, k_CxD, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
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
