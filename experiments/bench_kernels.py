"""Tree attention, every implementation checked against the reference and timed: the kernels' GPU check.

  python experiments/bench_kernels.py --out=runs/bench_kernels            # on a GPU: the whole sweep
  python experiments/bench_kernels.py --smoke --out=/tmp/bench_kernels    # anywhere: a tiny size, checks only

The attention shape comes from --config (default configs/r1_7b.py: 28 query / 4 KV heads, head dim
128, its policy dtype bfloat16 and kv_block 512). Each measurement is one layer's attention (a
cache of two layers, the layer index traced as a scanned decoder gives it) for `batch` rows, every
row filled to `filled` slots, then a causal tree of `tree` new tokens (decode: 1). Every
implementation's output is checked against the blockwise reference computed in float32 from the
same inputs, then timed: the median of --repeats calls after a warm-up call (compilation
excluded), each to `block_until_ready`. Its bandwidth is the bytes attention has to move (the keys
and values of the filled slots and the tree, the queries, the output) over that time, and its
fraction of the GPU's peak where the device kind is in PEAK_BANDWIDTH (else GB/s only).

Implementations: on a GPU xla, pallas_gpu and triton; on a TPU xla and pallas_tpu (--impls to
choose; `dense` is the reference without blocks). Off an accelerator (and with --smoke) a tiny
float32 sweep runs the kernels in their interpreters (Pallas', and Triton's where triton imports
with TRITON_INTERPRET=1): the checks hold, the timings mean nothing and are flagged so.

Writes results.json, results.csv, bandwidth.png and xla_hlo.txt (the optimized HLO of the xla path at
the sweep's first size: on an H200 it cost ~6 ms whatever the filled length, at batch 64, as if it
touched the whole cache) under --out and prints one JSON line per
measurement; exits 1 if any implementation failed or missed the reference. --time_limit_s: no
measurement starts after that many seconds of the sweep; what was measured is written as usual and
results.json says how many of the sweep's measurements were left (`left`).
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import sys
import time

import matplotlib

matplotlib.use("Agg")
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
from absl import app, flags  # pylint: disable=wrong-import-position
from ml_collections import config_flags  # pylint: disable=wrong-import-position

from tlt_jax.kernels import tree_attention, triton_gpu  # pylint: disable=wrong-import-position

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(os.path.dirname(__file__), "..", "configs",
                                                                 "r1_7b.py"), "Config giving the attention shape.")
_OUT = flags.DEFINE_string("out", "runs/bench_kernels", "Output directory.")
_SMOKE = flags.DEFINE_bool("smoke", None, "A tiny float32 sweep in the interpreters, checks only (default: off "
                           "an accelerator). The sweep flags below then default to its sizes.")
_BATCH = flags.DEFINE_list("batch", None, "Rows (default 1,4,16,64; smoke 2).")
_TREE = flags.DEFINE_list("tree", None, "New tokens per row, T (default 1,8,16,32,64; smoke 1,8).")
_FILLED = flags.DEFINE_list("filled", None, "Filled cache lengths (default 512 .. 32768; smoke 16,40).")
_IMPLS = flags.DEFINE_list("impls", None, "Implementations (default: the backend's; dense: the reference "
                           "without blocks).")
_BLOCK = flags.DEFINE_integer("block", None, "Attention block (default: the config's kv_block; smoke 16).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "float16", "bfloat16"], "Query and cache dtype (default: "
                           "the config's policy dtype; smoke float32).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per measurement (median reported).")
_TIME_LIMIT = flags.DEFINE_float("time_limit_s", 0.0, "Start no measurement after this many seconds of the sweep "
                                 "(0: no limit).", lower_bound=0.0)

# Peak HBM bandwidth (bytes/s) by a substring of jax's device_kind.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 SXM": 3.35e12, "H100 NVL": 3.9e12,
                  "H100 PCIe": 2.0e12, "A100-SXM4-80GB": 2.0e12, "A100 80GB": 2.0e12}
SWEEP = dict(batch=[1, 4, 16, 64], tree=[1, 8, 16, 32, 64], filled=[512, 1024, 2048, 4096, 8192, 16384, 32768])
SMOKE = dict(batch=[2], tree=[1, 8], filled=[16, 40], block=16, dtype="float32")
ATOL = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 2e-2}  # float32: XLA may take TF32 matmuls on a GPU
LAYERS = 2


def peak_bandwidth(device_kind: str) -> float | None:
  return next((v for k, v in PEAK_BANDWIDTH.items() if k in device_kind), None)


def implementations(backend: str) -> list[str]:
  impls = {"gpu": ["xla", "pallas_gpu", "triton"], "tpu": ["xla", "pallas_tpu"]}.get(backend)
  if impls is None:  # the interpreters
    impls = ["xla", "pallas_gpu", "pallas_tpu"] + (["triton"] if triton_gpu.interpreting() else [])
  return impls


def attention_fn(impl: str, block: int, backend: str):
  """jit(layer, q, k, v, lengths, mask) -> [B, T, H, D] by `impl`; Triton's interpreter off a GPU."""
  if impl == "triton" and backend != "gpu":
    return jax.jit(lambda layer, q, k, v, lengths, mask: triton_gpu.tree_attention(
        q, k, v, layer, lengths, mask, block=block, scale=q.shape[-1]**-0.5, interpret=True))
  impl, block = ("xla", None) if impl == "dense" else (impl, block)
  return jax.jit(lambda layer, q, k, v, lengths, mask: tree_attention.attention(q, k, v, layer, lengths, mask,
                                                                                impl=impl, block=block))


def timed(fn, *args, repeats: int) -> tuple[jax.Array, float]:
  """(the output of a warm-up call, the median seconds of `repeats` more)."""
  out = jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return out, statistics.median(times)


def sweep(model, impls, sizes, block, dtype, repeats, backend, peak, smoke, time_limit_s=0.0, hlo_path=None):
  """(one record per (batch, tree, filled, implementation), the measurements `time_limit_s` left out);
  `hlo_path`: where to write the xla path's optimized HLO at the first size."""
  heads, kv_heads, d = model.num_heads, model.num_kv_heads, model.head_dim
  capacity = -(-(max(sizes["filled"]) + max(sizes["tree"])) // block) * block
  layer, records = jnp.int32(1), []
  deadline = time.perf_counter() + time_limit_s if time_limit_s else float("inf")
  planned = len(impls) * len(sizes["batch"]) * len(sizes["tree"]) * len(sizes["filled"])
  fns = {impl: attention_fn(impl, block, backend) for impl in impls}
  reference = jax.jit(lambda q, k, v, lengths, mask: tree_attention.reference(q, k, v, 0, lengths, mask, block=block))
  for b in sizes["batch"]:
    if time.perf_counter() > deadline:
      break
    keys = jax.random.split(jax.random.key(b), 3)
    k, v = (jax.random.normal(key, (LAYERS, b, capacity, kv_heads, d), dtype) for key in keys[:2])
    k32, v32 = (x[1:2].astype(jnp.float32) for x in (k, v))  # the measured layer
    for t in sizes["tree"]:
      q = jax.random.normal(keys[2], (b, t, heads, d), dtype)
      mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
      for filled in sizes["filled"]:
        if time.perf_counter() > deadline:
          break
        lengths = jnp.full((b,), filled, jnp.int32)
        want = np.asarray(reference(q.astype(jnp.float32), k32, v32, lengths, mask))
        moved = (2 * b * (filled + t) * kv_heads + 2 * b * t * heads) * d * jnp.dtype(dtype).itemsize
        for impl in impls:
          record = dict(backend=backend, impl=impl, batch=b, tree=t, filled=filled, dtype=jnp.dtype(dtype).name,
                        block=block, ok=False, max_abs_err=None, error=None, ms=None, gb_per_s=None,
                        peak_fraction=None, timing="meaningless (interpreter or CPU)" if smoke else "measured")
          try:
            if impl == "xla" and hlo_path and not os.path.exists(hlo_path):
              with open(hlo_path, "w", encoding="utf-8") as f:
                f.write(fns[impl].lower(layer, q, k, v, lengths, mask).compile().as_text())
            got, seconds = timed(fns[impl], layer, q, k, v, lengths, mask, repeats=repeats)
          except Exception as e:  # pylint: disable=broad-except
            record["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:500]  # the rest of the sweep goes on
          else:
            err = float(np.abs(np.asarray(got, np.float32) - want).max())
            record.update(ok=err <= ATOL[record["dtype"]], max_abs_err=err, ms=seconds * 1e3,
                          gb_per_s=moved / seconds / 1e9, peak_fraction=peak and moved / seconds / peak)
          records.append(record)
          print(json.dumps(record), flush=True)
    del k, v, k32, v32
  return records, planned - len(records)


def plot(records, path, title, fraction):
  trees, batches = sorted({r["tree"] for r in records}), sorted({r["batch"] for r in records})
  fig, axes = plt.subplots(len(trees), len(batches), figsize=(max(6.4, 3.2 * len(batches)), 2.6 * len(trees)),
                           squeeze=False, sharex=True, sharey=True)
  y = "peak_fraction" if fraction else "gb_per_s"
  for i, t in enumerate(trees):
    for j, b in enumerate(batches):
      ax = axes[i][j]
      for impl in dict.fromkeys(r["impl"] for r in records):
        cell = [r for r in records if (r["impl"], r["tree"], r["batch"]) == (impl, t, b) and r[y] is not None]
        if cell:
          ax.plot([r["filled"] for r in cell], [r[y] for r in cell], marker="o", label=impl)
      ax.set_xscale("log", base=2)
      ax.set_title(f"batch {b}, T = {t}", fontsize=9)
      if i == len(trees) - 1:
        ax.set_xlabel("filled length")
      if j == 0:
        ax.set_ylabel("fraction of peak bandwidth" if fraction else "GB/s")
  axes[0][0].legend(fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(_):
  backend = jax.default_backend()
  smoke = backend not in ("gpu", "tpu") if _SMOKE.value is None else _SMOKE.value
  base = SMOKE if smoke else {**SWEEP, "block": _CONFIG.value.rollout.engine.kv_block,
                              "dtype": _CONFIG.value.policy.dtype}
  sizes = {name: [int(x) for x in (flag.value or base[name])]
           for name, flag in (("batch", _BATCH), ("tree", _TREE), ("filled", _FILLED))}
  block, dtype = _BLOCK.value or base["block"], jnp.dtype(_DTYPE.value or base["dtype"])
  impls = _IMPLS.value or implementations(backend)
  known = ("dense", *tree_attention.IMPLEMENTATIONS)
  if unknown := [i for i in impls if i not in known]:
    print(f"error: --impls: {unknown[0]!r} is not one of {known}", file=sys.stderr)
    sys.exit(1)
  device = jax.devices()[0]
  peak = peak_bandwidth(device.device_kind)
  os.makedirs(_OUT.value, exist_ok=True)
  hlo_path = os.path.join(_OUT.value, "xla_hlo.txt")
  if os.path.exists(hlo_path):
    os.remove(hlo_path)
  records, left = sweep(_CONFIG.value.model, impls, sizes, block, dtype, 1 if smoke else _REPEATS.value, backend,
                        peak, smoke, _TIME_LIMIT.value, hlo_path)

  summary = dict(backend=backend, device_kind=device.device_kind, peak_bytes_per_s=peak, smoke=smoke,
                 jax=jax.__version__, heads=_CONFIG.value.model.num_heads, kv_heads=_CONFIG.value.model.num_kv_heads,
                 head_dim=_CONFIG.value.model.head_dim, left=left, results=records)
  with open(os.path.join(_OUT.value, "results.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1)
  with open(os.path.join(_OUT.value, "results.csv"), "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=list(records[0]) if records else [])
    writer.writeheader()
    writer.writerows(records)
  title = f"tree attention on {device.device_kind} ({dtype.name}, block {block})"
  if records:
    plot(records, os.path.join(_OUT.value, "bandwidth.png"),
         title + (": smoke, timings meaningless" if smoke else ""), peak is not None)
  failed = [r for r in records if not r["ok"]]
  if failed:
    print(f"error: {len(failed)} of {len(records)} measurements failed or missed the reference "
          f"({', '.join(sorted({r['impl'] for r in failed}))}); see {_OUT.value}/results.json", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
