"""Tree attention as a Triton kernel (`triton.language`), called through `jax_triton.triton_call`.

Grid (query tile, row x KV head, split). A program holds one tile of a KV head's grouped queries
(G x T rows, g-major, zero-padded to whole tiles of at most 64 rows: GQA in one matmul) and walks
its share of the row's live slots, the prefix and the window together: cdiv(length + W, tile)
tiles, a trip count read at run time, so the cost tracks the filled length, not the capacity. A
slot before `lengths[b]` is seen by every query, a window slot by the queries its tree mask (read
straight from [B, T, W]) says. Tile i of row b is read from page `pages[b, i * tile // P]` of the
[L, N, P, K, D] cache at the layer index (a run-time value, so one kernel serves a scanned
decoder), with int64 offsets: a 7B model's cache holds more than 2^31 elements. A contiguous cache
is the table with one page per row. Splitting the walk (flash-decoding, as `pallas_gpu`) keeps the
GPU busy when a few long rows are left; the splits' softmax states are merged outside
(`layout.merge_splits`).

The walk's tile is min(block, 64) slots: `block` (the engine's `kv_block`) sets how the cache is
laid out (pages are multiples of it), while the tile is what fits a program's shared memory (K and
V tiles of 512 x 128 bf16 slots would not). Untuned: tile sizes, warps, stages, the split count.

Needs the `gpu` extra (`jax_triton`, `triton`) and an NVIDIA GPU: `jax_triton` imports only with
a CUDA-enabled jaxlib and compiles for the local GPU. `interpret=True` runs the same kernel in
Triton's interpreter instead (on CPU, through torch tensors, in a `jax.pure_callback`; slow, for
tests), which needs TRITON_INTERPRET=1 set before triton is imported (tests/conftest.py sets it)
and does not support bfloat16.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.kernels import layout

tl = None  # triton.language, bound by `_jitted`: triton (the gpu extra) is imported when the kernel is needed

_TILE = 64  # cache slots per step of the walk, at most
_ROWS = 64  # grouped query rows per program, at most
# The interpreter patches `triton.language` while a kernel runs: one at a time (under a mesh every
# device's callback runs in its own thread).
_INTERPRETER = threading.Lock()


def _kernel(lengths_ptr, layer_ptr, pages_ptr, q_ptr, k_ptr, v_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr,
            SCALE: tl.constexpr, NEG: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr, R: tl.constexpr,
            T: tl.constexpr, W: tl.constexpr, D: tl.constexpr, KV: tl.constexpr, N: tl.constexpr, P: tl.constexpr,
            M: tl.constexpr, SPLITS: tl.constexpr):
  """Operands as `tree_attention` passes them; writes the program's softmax state (m, l, acc)."""
  tile_r, bk, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
  row, kh = bk // KV, bk % KV
  length = tl.load(lengths_ptr + row)
  layer = tl.load(layer_ptr).to(tl.int64)
  r = tile_r * ROWS + tl.arange(0, ROWS)
  d = tl.arange(0, D)
  c = tl.arange(0, TILE)
  q = tl.load(q_ptr + (bk * R + r)[:, None] * D + d[None, :])
  m = tl.full((ROWS,), NEG, tl.float32)
  l = tl.zeros((ROWS,), tl.float32)
  acc = tl.zeros((ROWS, D), tl.float32)
  end = length + W
  n_tiles = tl.cdiv(end, TILE)
  per_split = tl.cdiv(n_tiles, SPLITS)
  lo = split * per_split
  for i in range(lo, tl.minimum(lo + per_split, n_tiles)):
    slot = i * TILE + c
    # A page the row does not hold (entry N) is never live; clamped, it is never read out of bounds.
    page = tl.minimum(tl.load(pages_ptr + row * M + i * TILE // P), N - 1).to(tl.int64)
    at = (((layer * N + page) * P + slot % P) * KV + kh)[:, None] * D + d[None, :]
    live = (slot < end)[:, None]  # slots past the window are never read: whatever they hold
    k = tl.load(k_ptr + at, mask=live, other=0.0).to(q.dtype)  # q holds the wider dtype of the two
    v = tl.load(v_ptr + at, mask=live, other=0.0)
    rel = slot - length  # window slot, negative in the prefix
    window = (rel >= 0) & (rel < W)
    tree = tl.load(mask_ptr + (row * T + r % T)[:, None] * W + rel[None, :], mask=window[None, :], other=0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * SCALE  # ieee: float32 caches without tf32 rounding
    s = tl.where((rel < 0)[None, :] | (tree != 0), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    rescale = tl.exp(m - m_new)
    l = l * rescale + tl.sum(p, 1)
    acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    m = m_new
  out = (bk * SPLITS + split) * R + r
  tl.store(m_ptr + out, m)
  tl.store(l_ptr + out, l)
  tl.store(acc_ptr + out[:, None] * D + d[None, :], acc)


@functools.cache
def _jitted():
  """The kernel through `triton.jit`: compiled, or interpreted where TRITON_INTERPRET=1 was set
  when triton was first imported."""
  global tl  # pylint: disable=global-statement
  try:
    import triton  # pylint: disable=import-outside-toplevel
    from triton import language  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ValueError("attention='triton' needs the gpu extra: pip install 'tlt_jax[gpu]' (jax-triton, "
                     "triton)") from e
  tl = language  # the kernel's body reads it from this module's globals
  return triton.jit(_kernel)


def _launch(operands, out_shapes, grid, constants, compute_capability):
  """The kernel on the GPU, compiled by `jax_triton` while lowering (to PTX, for the local GPU's
  compute capability unless one is given)."""
  try:
    import jax_triton  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ValueError(f"attention='triton' needs the gpu extra (pip install 'tlt_jax[gpu]') and a CUDA-enabled "
                     f"jaxlib: {e}") from e
  return jax_triton.triton_call(*operands, kernel=_jitted(), out_shape=out_shapes, grid=grid, num_warps=4,
                                num_stages=2, compute_capability=compute_capability, **constants)


def interpreting() -> bool:
  """Whether the kernel runs in Triton's interpreter here: triton is installed, and TRITON_INTERPRET=1
  was set when it was imported (Triton's own library functions, `tl.cdiv`, `tl.max`, ..., are
  decorated then)."""
  try:
    kernel = _jitted()
  except ValueError:
    return False
  from triton.runtime.interpreter import InterpretedFunction  # pylint: disable=import-outside-toplevel
  return isinstance(kernel, InterpretedFunction)


def _interpret(operands, out_shapes, grid, constants):
  """The kernel in Triton's interpreter, on the host (torch CPU tensors), inside a callback."""
  if not interpreting():
    raise ValueError("the triton kernel's interpret=True needs TRITON_INTERPRET=1 in the environment before "
                     "triton is imported")
  if any(x.dtype == jnp.bfloat16 for x in operands):
    raise ValueError("Triton's interpreter does not support bfloat16 (its matmul multiplies the bit patterns): "
                     "interpret the kernel on float32 or float16")

  def host(*arrays):
    import torch  # pylint: disable=import-outside-toplevel
    outs = [torch.zeros(s.shape, dtype=torch.float32) for s in out_shapes]
    with _INTERPRETER:
      _jitted()[grid](*(torch.from_numpy(np.array(x)) for x in arrays), *outs, **constants)  # writable copies
    return [o.numpy() for o in outs]

  return jax.pure_callback(host, out_shapes, *operands)


def tree_attention(q_BxTxHxD, k_LxNxPxKxD, v_LxNxPxKxD, layer, lengths_B, mask_BxTxW, *, block: int,
                   scale: float, interpret: bool = False, pages_BxM=None, compute_capability: int | None = None):
  """`tree_attention.reference` semantics on an NVIDIA GPU; `interpret=True` runs Triton's
  interpreter (CPU). `layer` may be traced (a scanned decoder's layer index). `compute_capability`
  (90: H100 / H200) compiles for that GPU instead of the local one: `jax.export` without a GPU."""
  b, t, h, d = q_BxTxHxD.shape
  _, n_pages, page_size, kv_heads, _ = k_LxNxPxKxD.shape
  layout.require_pow2("triton", {"attention block": block, "head dim": d})
  tile, groups = min(block, _TILE), h // kv_heads
  r = groups * t
  rows = min(layout.pow2(r), _ROWS)
  r_pad = -(-r // rows) * rows
  table = layout.table(pages_BxM, b)
  q = layout.group_queries(q_BxTxHxD, kv_heads).astype(jnp.promote_types(q_BxTxHxD.dtype, k_LxNxPxKxD.dtype))
  q = jnp.pad(q, ((0, 0), (0, 0), (0, r_pad - r), (0, 0)))  # padded rows: zero queries, never read back
  programs = r_pad // rows * b * kv_heads
  splits = layout.splits(page_size * table.shape[1] // tile, programs)
  constants = dict(SCALE=float(scale), NEG=layout.NEG, TILE=tile, ROWS=rows, R=r_pad, T=t, W=mask_BxTxW.shape[2], D=d,
                   KV=kv_heads, N=n_pages, P=page_size, M=table.shape[1], SPLITS=splits)
  part = lambda *shape: jax.ShapeDtypeStruct((b, kv_heads, splits, r_pad, *shape), jnp.float32)
  operands = (lengths_B.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32), table.reshape(-1), q,
              k_LxNxPxKxD, v_LxNxPxKxD, mask_BxTxW.astype(jnp.int8))
  grid, out_shapes = (r_pad // rows, b * kv_heads, splits), [part(), part(), part(d)]
  _jitted()  # triton is there, or a ValueError says what is missing
  if interpret:
    m, l, acc = _interpret(operands, out_shapes, grid, constants)
  else:
    m, l, acc = _launch(operands, out_shapes, grid, constants, compute_capability)
  return layout.ungroup(layout.merge_splits(m, l, acc)[:, :, :r].astype(v_LxNxPxKxD.dtype), t)
