"""Attention of T new tokens per row over that row's KV cache: the verify step's `tree_attention`.

Semantics (shared by every implementation). Row b's cache holds its prefix in slots
`[0, lengths[b])`, then a window of W slots: W - T tree tokens written by earlier calls (the
drafter's previous tree levels; none for the target) and the T new tokens' keys/values last.
Query t sees
  * every prefix slot, and
  * window slot w iff `mask_BxTxW[b, t, w]` (causal for prefill, the draft tree's ancestor
    mask for verification, a single True for decode).
Every query must see at least itself.

Implementations, one signature (`attention` picks one):
  * `xla`: the pure-jnp `reference` below; always available, the default on CPU. With
    `block=None` it is one dense softmax over the whole cache (differentiable; what training
    uses). With `block=C` it walks the cache in blocks of C slots with an online softmax and
    stops after the last block any row uses, so its cost tracks the filled length, not the
    cache capacity: a 32k-token cache costs nothing until it is filled.
  * `pallas_tpu` (`pallas_tpu.py`, Mosaic TPU) and `pallas_gpu` (`pallas_gpu.py`, Pallas'
    Triton backend): fused kernels with the same blockwise cost. They have run only on CPU, in
    the Pallas interpreters, and have been lowered (`jax.export`) for TPU and CUDA; see
    docs/STATUS.md.
  * `triton` (`triton_gpu.py`): the same op written in `triton.language` and called through
    `jax_triton`; NVIDIA GPUs only (the `gpu` extra). It has run only in Triton's interpreter on
    CPU and been lowered for CUDA.
Decode is the same op with T = W = 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tlt_jax import sharding, targets
from tlt_jax.kernels import layout, pallas_gpu, pallas_tpu, triton_gpu

IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu", "triton")
_NATIVE = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}  # backend -> its kernel
_KERNELS = {"pallas_tpu": pallas_tpu.tree_attention, "pallas_gpu": pallas_gpu.tree_attention,
            "triton": triton_gpu.tree_attention}


def _check_block(cache_LxNxPxKxD, pages_BxM, block: int):
  page = cache_LxNxPxKxD.shape[2]
  if page % block:
    what = "cache capacity" if pages_BxM is None else "page size"
    raise ValueError(f"{what} {page} is not a multiple of the attention block {block}")


def _visible(lengths_B, mask_BxTxW, start, size):
  """[B, T, size] bool: which of the slots start..start+size-1 each query sees."""
  b, t, w = mask_BxTxW.shape
  rel_BxC = start + jnp.arange(size)[None, :] - lengths_B[:, None]
  idx = jnp.broadcast_to(jnp.clip(rel_BxC, 0, w - 1)[:, None, :], (b, t, size))
  new = jnp.take_along_axis(mask_BxTxW, idx, axis=2) & ((rel_BxC >= 0) & (rel_BxC < w))[:, None, :]
  return (rel_BxC < 0)[:, None, :] | new


def _scores(q_BxTxKxGxD, k_BxCxKxD, visible_BxTxC, scale):
  s = jnp.einsum("btkgd,bckd->bkgtc", q_BxTxKxGxD, k_BxCxKxD, preferred_element_type=jnp.float32) * scale
  return jnp.where(visible_BxTxC[:, None, None], s, -jnp.inf)


def dense(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, visible_BxTxS, scale: float | None = None):
  """[B, T, H, D] attention of T queries over S keys / values (GQA: H = K x groups), query t seeing key s
  iff `visible_BxTxS[b, t, s]`: one dense, differentiable softmax. Training's self-attention (the keys are
  the queries' own tokens, no cache) and the cache's `reference` without blocks."""
  b, t, h, d = q_BxTxHxD.shape
  kv_heads = k_BxSxKxD.shape[2]
  q = q_BxTxHxD.reshape(b, t, kv_heads, h // kv_heads, d)
  s = _scores(q, k_BxSxKxD, visible_BxTxS, d**-0.5 if scale is None else scale)
  p = jax.nn.softmax(s, axis=-1).astype(v_BxSxKxD.dtype)
  return jnp.einsum("bkgtc,bckd->btkgd", p, v_BxSxKxD).reshape(b, t, h, d)


def reference(q_BxTxHxD, k_LxNxPxKxD, v_LxNxPxKxD, layer, lengths_B, mask_BxTxW, *, block: int | None = None,
              scale: float | None = None, pages_BxM=None):
  """[B, T, H, D] attention outputs over layer `layer` of the caches (GQA: H = K x groups).

  The caches hold every layer so that the blockwise path slices blocks straight out of them:
  slicing the layer first would copy the whole layer cache at every step. `layer` is a Python
  int (unrolled decoder) or a traced index (scanned decoder): every implementation takes both.
  `pages_BxM`: the rows' page tables of a paged cache (`layout`), None for a contiguous one.
  """
  b, t, h, d = q_BxTxHxD.shape
  s_cap, kv_heads = layout.capacity(k_LxNxPxKxD, pages_BxM), k_LxNxPxKxD.shape[3]
  if block is None:
    return dense(q_BxTxHxD, layout.rows(k_LxNxPxKxD, layer, pages_BxM), layout.rows(v_LxNxPxKxD, layer, pages_BxM),
                 _visible(lengths_B, mask_BxTxW, 0, s_cap), scale)
  scale = d**-0.5 if scale is None else scale
  q = q_BxTxHxD.reshape(b, t, kv_heads, h // kv_heads, d)

  _check_block(k_LxNxPxKxD, pages_BxM, block)
  n_blocks = jnp.minimum((jnp.max(lengths_B) + mask_BxTxW.shape[2] + block - 1) // block, s_cap // block)

  def body(i, carry):
    m, l, acc = carry
    start = i * block
    k = layout.block(k_LxNxPxKxD, layer, pages_BxM, start, block, b)
    v = layout.block(v_LxNxPxKxD, layer, pages_BxM, start, block, b)
    s = _scores(q, k, _visible(lengths_B, mask_BxTxW, start, block), scale)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])
    rescale = jnp.exp(m - m_new)
    l = l * rescale + p.sum(axis=-1)
    acc = acc * rescale[..., None] + jnp.einsum("bkgtc,bckd->bkgtd", p.astype(v.dtype), v,
                                                preferred_element_type=jnp.float32)
    return m_new, l, acc

  g = h // kv_heads
  init = (jnp.full((b, kv_heads, g, t), layout.NEG, jnp.float32), jnp.zeros((b, kv_heads, g, t), jnp.float32),
          jnp.zeros((b, kv_heads, g, t, d), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
  out = (acc / l[..., None]).astype(v_LxNxPxKxD.dtype)  # [B, K, G, T, D]
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def select(impl: str, backend: str) -> tuple[str, bool]:
  """(implementation, interpret) that `impl` means on `backend` ("cpu", "gpu" or "tpu").

  `auto` and `pallas` take the backend's kernel and fall back to `xla` where it has none (CPU).
  `pallas_tpu` / `pallas_gpu` name one kernel: it runs natively on its hardware and in the
  Pallas interpreter anywhere else (slow: for tests and checks). `triton` runs on a GPU only
  (`jax_triton` compiles for the local one): anywhere else it is refused, not replaced.
  """
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation {impl!r} is not one of {IMPLEMENTATIONS}")
  if impl == "triton":
    if backend != "gpu":
      raise ValueError(f"attention='triton' needs an NVIDIA GPU (jax_triton compiles its kernel for the local GPU); "
                       f"the backend here is {backend!r}: use 'xla', or 'pallas_gpu' (Pallas interpreter off a GPU)")
    return "triton", False
  if impl in ("auto", "pallas"):
    return _NATIVE.get(backend, "xla"), False
  if impl == "xla":
    return "xla", False
  return impl, _NATIVE.get(backend) != impl


def platform() -> str:
  """The platform being compiled for: that of the mesh set while tracing (`jax.set_mesh`: a dry run's
  target devices, compiled for without being here), else the default backend's."""
  device = jax.sharding.get_abstract_mesh().abstract_device
  return jax.default_backend() if device is None else device.platform


def attention(q_BxTxHxD, k_LxNxPxKxD, v_LxNxPxKxD, layer, lengths_B, mask_BxTxW, *, impl: str = "auto",
              block: int | None = None, scale: float | None = None, pages_BxM=None):
  """[B, T, H, D] tree attention by implementation `impl` (see `select`) for the platform compiled for
  (`platform`), over a contiguous cache or, with `pages_BxM`, a paged one (`layout`).

  `block=None` always takes the dense, differentiable reference: the kernels have no gradient.
  Under a multi-device mesh the kernels need it set while tracing (`jax.set_mesh`); see
  `per_device`.
  """
  kernel, interpret = select(impl, platform())
  if block is None or kernel == "xla":
    return reference(q_BxTxHxD, k_LxNxPxKxD, v_LxNxPxKxD, layer, lengths_B, mask_BxTxW, block=block, scale=scale,
                     pages_BxM=pages_BxM)
  _check_block(k_LxNxPxKxD, pages_BxM, block)
  scale = q_BxTxHxD.shape[-1]**-0.5 if scale is None else scale
  options = {"compute_capability": targets.compute_capability(jax.sharding.get_abstract_mesh())} \
      if kernel == "triton" else {}
  run = lambda q, k, v, lengths, mask, pages: _KERNELS[kernel](q, k, v, layer, lengths, mask, block=block,
                                                               scale=scale, interpret=interpret, pages_BxM=pages,
                                                               **options)
  return per_device(run, q_BxTxHxD, k_LxNxPxKxD, v_LxNxPxKxD, lengths_B, mask_BxTxW, pages_BxM)


def per_device(kernel, q_BxTxHxD, k_LxNxPxKxD, v_LxNxPxKxD, lengths_B, mask_BxTxW, pages_BxM=None):
  """`kernel(q, k, v, lengths, mask, pages)`, run by each device on its own rows and KV heads under
  the mesh set while tracing (`jax.set_mesh`), if it has several devices.

  XLA cannot partition a Pallas call (Mosaic refuses to lower one over sharded operands); the
  op is independent per row and per KV head, so the split follows the cache's (`CACHE_AXES`).
  A paged cache's pages are split like its rows: device d holds the pool's d-th equal range of
  pages, and each row's pages must lie in its device's range (the engine allocates them so,
  `Pages(shards=...)`); each device reads its rows' pages by their index in its range.
  """
  args = (q_BxTxHxD, k_LxNxPxKxD, v_LxNxPxKxD, lengths_B, mask_BxTxW)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return kernel(*args, pages_BxM)
  cache = sharding.logical_spec(k_LxNxPxKxD.shape, (None, *sharding.CACHE_AXES), dict(mesh.shape))
  heads = cache[3]
  rows = sharding.logical_spec(lengths_B.shape, ("batch",), dict(mesh.shape))[0]
  q = jax.P(rows, None, heads, None)
  specs = (q, cache, cache, jax.P(rows), jax.P(rows, None, None))
  if pages_BxM is None:
    return jax.shard_map(lambda *a: kernel(*a, None), mesh=mesh, in_specs=specs, out_specs=q, check_vma=False)(*args)
  if rows != cache[1]:
    raise ValueError(f"a paged cache under a mesh needs its {lengths_B.shape[0]} rows split like its "
                     f"{k_LxNxPxKxD.shape[1]} pages (over mesh axes {cache[1]}, sizes {dict(mesh.shape)}): "
                     f"rows got {rows}; make the batch (rollout.engine.batch_buckets) a multiple of those axes' size")

  def local(q, k, v, lengths, mask, pages):
    n = k.shape[1]  # this device's pages: global pages first .. first + n - 1
    first = 0 if rows is None else jax.lax.axis_index(rows) * n
    pages = jnp.where((pages >= first) & (pages < first + n), pages - first, n)  # n: no page here
    return kernel(q, k, v, lengths, mask, pages)

  return jax.shard_map(local, mesh=mesh, in_specs=(*specs, jax.P(rows, None)), out_specs=q,
                       check_vma=False)(*args, pages_BxM)
