"""The Triton tree-attention kernel: its body in Triton's interpreter (CPU) against brute-force NumPy,
contiguous and paged, decode and trees, GQA, a traced layer, under a mesh; and, where `jax_triton`
imports (a CUDA-enabled jaxlib), its lowering for CUDA through Triton to PTX.

The interpreter does not support bfloat16 (its matmul multiplies the bit patterns): the shared
cases' bfloat16 ones run in float16 here, the same half-precision path (P rounded to the values'
dtype for the second matmul). bfloat16 itself is only lowered."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.conftest import BLOCK, CASES, PAGE, brute_force, case_inputs, paged
from tlt_jax import sharding
from tlt_jax.kernels import tree_attention, triton_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("triton", reason="the triton package is not installed (the test or gpu extra)")
pytest.importorskip("torch", reason="Triton's interpreter takes torch tensors")


def interpreted(block):
  """The kernel in Triton's interpreter, jitted, the layer index traced."""
  def run(layer, q, k, v, lengths, mask, pages_BxM=None):
    return triton_gpu.tree_attention(q, k, v, layer, lengths, mask, block=block, scale=q.shape[-1]**-0.5,
                                     interpret=True, pages_BxM=pages_BxM)
  return jax.jit(run)


def check(got, q, k, v, lengths, mask, dtype):
  f32 = lambda x: np.asarray(x, np.float32)  # the exact answer for the (possibly float16-rounded) inputs
  want = brute_force(f32(q), f32(k), f32(v), lengths, mask)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-5 if dtype == "float32" else 2e-2, rtol=0)
  assert got.dtype == q.dtype


def test_the_interpreter_is_on():
  assert triton_gpu.interpreting(), "tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported"


HALF_CASES = [(*c[:-1], "float16" if c[-1] == "bfloat16" else c[-1]) for c in CASES]


@pytest.mark.parametrize("case", HALF_CASES, ids=lambda c: "g{}_d{}_v{}_e{}_{}".format(*c))
def test_matches_brute_force(case):
  q, k, v, lengths, mask = case_inputs(*case)
  check(interpreted(BLOCK)(jnp.int32(1), q, k, v, lengths, mask), q, k[1], v[1], lengths, mask, case[-1])


@pytest.mark.parametrize("case", HALF_CASES[:3], ids=lambda c: "g{}_d{}_v{}_e{}_{}".format(*c))
def test_a_paged_cache_gives_the_contiguous_answer(case):
  q, k, v, lengths, mask = case_inputs(*case)
  kp, vp, pages = paged(k, v, lengths, mask.shape[2], PAGE)
  check(interpreted(BLOCK)(jnp.int32(1), q, kp, vp, lengths, mask, pages), q, k[1], v[1], lengths, mask, case[-1])


def test_the_layer_is_a_run_time_value():
  q, k, v, lengths, mask = case_inputs(4, 64, 5, 3, "float32")
  run = interpreted(BLOCK)
  for layer in (0, 1):
    check(run(jnp.int32(layer), q, k, v, lengths, mask), q, k[layer], v[layer], lengths, mask, "float32")


def test_a_block_larger_than_the_tile():
  """A 128-slot block (pages of 256) is walked in 64-slot tiles: rows end inside either tile of a block."""
  rng = np.random.RandomState(0)
  t, w, cap = 3, 5, 512
  lengths = np.asarray([0, 60, 130, 200, cap - w], np.int32)
  mask = rng.rand(len(lengths), t, w) < 0.5
  mask[:, :, w - t:] |= np.eye(t, dtype=bool)
  q = jnp.asarray(rng.randn(len(lengths), t, 4, 32), jnp.float32)
  k, v = (jnp.asarray(rng.randn(1, len(lengths), cap, 2, 32), jnp.float32) for _ in range(2))
  check(interpreted(128)(jnp.int32(0), q, k, v, lengths, mask), q, k[0], v[0], lengths, mask, "float32")
  kp, vp, pages = paged(k, v, lengths, w, 256)
  check(interpreted(128)(jnp.int32(0), q, kp, vp, lengths, mask, pages), q, k[0], v[0], lengths, mask, "float32")


def test_under_a_mesh_each_device_runs_its_rows_and_heads():
  q, k, v, lengths, mask = case_inputs(4, 64, 5, 3, "float32")
  run = lambda q, k, v, lengths, mask, pages: triton_gpu.tree_attention(q, k, v, 1, lengths, mask, block=BLOCK,
                                                                         scale=0.125, interpret=True, pages_BxM=pages)
  with jax.set_mesh(sharding.make_mesh({"data": 4, "tensor": 2})):
    got = jax.jit(lambda *a: tree_attention.per_device(run, *a))(q, k, v, lengths, mask)
  check(got, q, k[1], v[1], lengths, mask, "float32")


def test_shapes_triton_cannot_tile_are_named():
  q, k, v, lengths, mask = case_inputs(1, 64, 1, 0, "float32")
  with pytest.raises(ValueError, match="triton needs a power-of-two head dim >= 16, got 8"):
    triton_gpu.tree_attention(q[..., :8], k[..., :8], v[..., :8], 0, lengths, mask, block=BLOCK, scale=1.0,
                              interpret=True)
  with pytest.raises(ValueError, match="triton needs a power-of-two attention block >= 16, got 8"):
    triton_gpu.tree_attention(q, k, v, 0, lengths, mask, block=8, scale=1.0, interpret=True)
  with pytest.raises(ValueError, match="Triton's interpreter does not support bfloat16"):
    triton_gpu.tree_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), 0, lengths, mask, block=BLOCK, scale=1.0,
                              interpret=True)


def test_the_interpreter_needs_triton_interpret_at_import():
  """Triton's own library functions (tl.cdiv, tl.max, ...) are compiled or interpreted from import on."""
  code = ("import numpy as np; from tlt_jax.kernels import triton_gpu; x = np.zeros((1, 1, 1, 16), np.float32); "
          "triton_gpu.tree_attention(x, np.zeros((1, 1, 16, 1, 16), np.float32), np.zeros((1, 1, 16, 1, 16), "
          "np.float32), 0, np.zeros(1, np.int32), np.ones((1, 1, 1), bool), block=16, scale=1.0, interpret=True)")
  proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "0"}, text=True,
                        capture_output=True, timeout=300)
  assert proc.returncode == 1
  assert "ValueError: the triton kernel's interpret=True needs TRITON_INTERPRET=1" in proc.stderr, proc.stderr[-2000:]


# ---- lowering for CUDA: needs `jax_triton`, which imports only with a CUDA-enabled jaxlib ----
LOWERINGS = [  # (dtype, T, W, paged, compute capability)
    ("float32", 16, 24, False, 90), ("bfloat16", 1, 1, False, 90),  # a drafter level; decode
    ("bfloat16", 16, 16, True, 90), ("bfloat16", 64, 64, False, 90),  # verify, paged; the largest tree
    ("bfloat16", 16, 16, False, 80),  # A100
]


def export(dtype, t, w, paged, capability):
  """jax.export for CUDA at R1-7B's attention shape (28 heads over 4 KV heads, head dim 128), the
  layer traced, compiled by Triton to PTX for the given compute capability (90: H100 / H200)."""
  f = lambda layer, q, k, v, lengths, mask, pages=None: triton_gpu.tree_attention(
      q, k, v, layer, lengths, mask, block=128, scale=0.1, pages_BxM=pages, compute_capability=capability)
  b, s = 8, 1024
  kv = ((4, 20, 256, 4, 128) if paged else (4, b, s, 4, 128), jnp.dtype(dtype))
  shapes = [jax.ShapeDtypeStruct(x, y) for x, y in [((), jnp.int32), ((b, t, 28, 128), jnp.dtype(dtype)), kv, kv,
                                                     ((b,), jnp.int32), ((b, t, w), jnp.bool_)]]
  if paged:
    shapes.append(jax.ShapeDtypeStruct((b, s // 256), jnp.int32))
  # The Triton custom call carries no cross-version stability guarantee; we only check it lowers.
  checks = [jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call")]
  return jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(*shapes)


def case_id(case) -> str:
  return "{}_t{}_w{}_paged{}_sm{}".format(*case)


def lower_all():
  """Exports every case, each one's Triton output (TTIR .. PTX) kept in JAX_TRITON_DUMP_DIR/<case>.
  Run in a process of its own, with TRITON_INTERPRET=0: Triton compiles or interprets, per process."""
  dump = os.environ["JAX_TRITON_DUMP_DIR"]
  for case in LOWERINGS:
    before = set(os.listdir(dump))
    exported = export(*case)
    (new,) = set(os.listdir(dump)) - before
    os.rename(os.path.join(dump, new), os.path.join(dump, case_id(case)))
    triton = "triton_kernel_call" in exported.mlir_module()
    print(json.dumps(dict(case=case, platforms=exported.platforms, triton=triton)))


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
  """{case: (its export's facts, the PTX Triton made for it)}."""
  pytest.importorskip("jax_triton", exc_type=ImportError,
                      reason="jax_triton needs a CUDA-enabled jaxlib (jax-cuda13-plugin): see docs/STATUS.md")
  dump = str(tmp_path_factory.mktemp("triton"))
  proc = subprocess.run([sys.executable, "-c", "from tests.kernels.test_triton_gpu import lower_all; lower_all()"],
                        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "0", "JAX_TRITON_DUMP_DIR": dump}, text=True,
                        capture_output=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = {tuple(r["case"]): r for r in map(json.loads, proc.stdout.splitlines())}
  return {case: (records[case], os.path.join(dump, case_id(case), "_kernel.ptx")) for case in LOWERINGS}


@pytest.mark.parametrize("case", LOWERINGS, ids=case_id)
def test_lowers_for_cuda_and_assembles(case, lowered):
  """Lowered for CUDA; the PTX assembles for its GPU with the ptxas Triton ships (CUDA 13.4 in triton
  3.9), in registers for bfloat16 (float32 matmuls, FMAs at ieee precision, spill: not the target)."""
  record, ptx = lowered[case]
  assert record["platforms"] == ["cuda"] and record["triton"]
  import triton  # pylint: disable=import-outside-toplevel
  ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
  target = re.search(r"^\.target (sm_\w+)", open(ptx).read(), re.M).group(1)
  assert target == f"sm_{case[-1]}" + ("a" if case[-1] >= 90 else "")
  proc = subprocess.run([ptxas, f"-arch={target}", "-v", ptx, "-o", os.devnull], text=True, capture_output=True)
  assert proc.returncode == 0, proc.stderr[-3000:]
  if case[0] == "bfloat16":
    assert "0 bytes spill stores, 0 bytes spill loads" in proc.stderr, proc.stderr
