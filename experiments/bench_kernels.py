"""Tree attention per implementation, side by side, at Qwen2.5-7B's attention shape.

  python experiments/bench_kernels.py [--batch=4 --tree=16 --capacity=8192 --filled=512,2048,8192]

One verify step's attention for one layer: `--batch` rows of `--tree` tree tokens over a
layer-stacked cache of `--capacity` slots per row, every row filled to each `--filled` length.
Implementations: the dense reference (`block=None`), the blockwise reference (`xla`), and the
backend's Pallas kernel where it has one (TPU, GPU; not CPU, where only the interpreter runs
them and its timings mean nothing). Each figure is the median of `--repeats` timed runs after a
warm-up run (compilation excluded). Prints one JSON record per measurement, with its speed-up
over the dense reference.
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from tlt_jax.kernels import tree_attention

_BATCH = flags.DEFINE_integer("batch", 4, "Rows.")
_TREE = flags.DEFINE_integer("tree", 16, "Tree tokens per row (V); 1 is decode.")
_CAPACITY = flags.DEFINE_integer("capacity", 8192, "Cache slots per row.")
_FILLED = flags.DEFINE_list("filled", ["512", "2048", "8192"], "Filled lengths to time (each < capacity).")
_BLOCK = flags.DEFINE_integer("block", 64, "Attention block (the engine's kv_block).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Cache and query dtype.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per measurement (median reported).")

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 28, 4, 128, 2  # Qwen2.5-7B's attention; two layers of cache


def timed(fn, *args) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(_REPEATS.value):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main(_):
  b, t, cap, dtype = _BATCH.value, _TREE.value, _CAPACITY.value, jnp.dtype(_DTYPE.value)
  rng = np.random.RandomState(0)
  q = jnp.asarray(rng.randn(b, t, HEADS, HEAD_DIM), dtype)
  k, v = (jnp.asarray(rng.randn(LAYERS, b, cap, KV_HEADS, HEAD_DIM), dtype) for _ in range(2))
  mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None].repeat(b, 0))
  kernel, _ = tree_attention.select("pallas", jax.default_backend())
  impls = {"dense": ("xla", None), "xla": ("xla", _BLOCK.value)}
  if kernel != "xla":
    impls[kernel] = (kernel, _BLOCK.value)
  for filled in map(int, _FILLED.value):
    lengths = jnp.full((b,), min(filled, cap - t), jnp.int32)
    seconds = {}
    for name, (impl, block) in impls.items():
      fn = jax.jit(lambda q, k, v, lengths, impl=impl, block=block: tree_attention.attention(
          q, k, v, 1, lengths, mask, impl=impl, block=block))
      seconds[name] = timed(fn, q, k, v, lengths)
    for name, s in seconds.items():
      print(json.dumps(dict(backend=jax.default_backend(), impl=name, filled=int(lengths[0]), capacity=cap, batch=b,
                            tree=t, dtype=str(dtype), ms=round(s * 1e3, 3),
                            speedup_vs_dense=round(seconds["dense"] / s, 2))))


if __name__ == "__main__":
  app.run(main)
