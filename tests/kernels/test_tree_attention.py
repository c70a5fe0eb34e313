"""Tree attention: the reference against brute-force NumPy, every implementation (the Pallas kernels
in interpret mode) against the reference, selection, and lowering of the kernels for TPU and CUDA.
The Triton kernel's own checks are in test_triton_gpu.py."""

import contextlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax import sharding
from tests.kernels.conftest import BLOCK, CASES, KV_HEADS, PAGE, brute_force, case_inputs, paged
from tlt_jax.kernels import pallas_gpu, pallas_tpu, tree_attention


@pytest.mark.parametrize("block", [None, 4, 8])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("earlier", [0, 3])  # tree tokens of earlier calls before the new ones
def test_matches_brute_force(block, groups, earlier):
  rng = np.random.RandomState(groups)
  b, t, kv, d, cap = 3, 5, 2, 8, 24
  lengths = np.asarray([0, 4, 11], np.int32)
  mask = rng.rand(b, t, earlier + t) < 0.5
  mask[:, :, earlier:] |= np.eye(t, dtype=bool)  # every query sees itself
  q = rng.randn(b, t, kv * groups, d).astype(np.float32)
  k = rng.randn(1, b, cap, kv, d).astype(np.float32)
  v = rng.randn(1, b, cap, kv, d).astype(np.float32)
  got = tree_attention.reference(q, k, v, 0, lengths, mask, block=block)
  np.testing.assert_allclose(got, brute_force(q, k[0], v[0], lengths, mask), atol=1e-5)


def test_capacity_must_be_a_multiple_of_the_block():
  x = np.zeros((1, 1, 1, 4), np.float32)
  with pytest.raises(ValueError, match="capacity 6 is not a multiple of the attention block 4"):
    tree_attention.reference(x, np.zeros((1, 1, 6, 1, 4), np.float32), np.zeros((1, 1, 6, 1, 4), np.float32), 0,
                             np.zeros(1, np.int32), np.ones((1, 1, 1), bool), block=4)


# ---- every implementation against the reference: one shared test base (tests/kernels/conftest.py) ----
@pytest.mark.parametrize("impl", ["xla", "pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "g{}_d{}_v{}_e{}_{}".format(*c))
def test_implementations_match_the_reference(impl, case):
  q, k, v, lengths, mask = case_inputs(*case)
  run = jax.jit(lambda q, k, v, lengths, mask: tree_attention.attention(q, k, v, 1, lengths, mask, impl=impl,
                                                                         block=BLOCK))
  got = np.asarray(run(q, k, v, lengths, mask), np.float32)
  f32 = lambda x: np.asarray(x, np.float32)  # the exact answer for the (possibly bf16-rounded) inputs
  want = brute_force(f32(q), f32(k[1]), f32(v[1]), lengths, mask)
  np.testing.assert_allclose(got, want, atol=1e-5 if case[-1] == "float32" else 2e-2, rtol=0)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_float32_queries_over_a_bfloat16_cache_as_the_reference(impl):
  """A float32 drafter over a bfloat16 cache: scores in float32, the values weighed in bfloat16 and the
  output in the cache's dtype, as `reference` computes them."""
  _, k, v, lengths, mask = case_inputs(4, 64, 5, 3, "bfloat16")
  q = jnp.asarray(np.random.RandomState(0).randn(*k.shape[1:2], 5, KV_HEADS * 4, 64), jnp.float32)
  want = tree_attention.reference(q, k, v, 1, lengths, mask, block=BLOCK)
  got = jax.jit(lambda *a: tree_attention.attention(*a, impl=impl, block=BLOCK))(q, k, v, 1, lengths, mask)
  assert got.dtype == want.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.float32(got), np.float32(want), atol=1e-2, rtol=0)


def test_the_gpu_kernel_walks_a_wide_block_in_tiles():
  """A cache block wider than the GPU kernel's 64-slot tile (configs/r1_7b.py's 512: its K and V tiles would
  overflow shared memory), over a paged cache."""
  q, _, _, _, mask = case_inputs(2, 16, 3, 0, "float32")
  rng = np.random.RandomState(1)
  k, v = (jnp.asarray(rng.randn(2, 4, 256, KV_HEADS, 16), jnp.float32) for _ in range(2))  # two blocks of 128
  lengths = np.asarray([0, 70, 131, 253], np.int32)
  kp, vp, pages = paged(k, v, lengths, mask.shape[2], 128)
  got = jax.jit(lambda *a: tree_attention.attention(*a[:6], impl="pallas_gpu", block=128, pages_BxM=a[6]))(
      q, kp, vp, 1, lengths, mask, pages)
  np.testing.assert_allclose(got, brute_force(q, k[1], v[1], lengths, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl,block", [("xla", None), ("xla", BLOCK), ("xla", 8), ("pallas_tpu", BLOCK),
                                        ("pallas_gpu", BLOCK)])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2]], ids=lambda c: "g{}_d{}_v{}_e{}_{}".format(*c))
def test_a_paged_cache_gives_the_contiguous_answer(impl, block, case):
  """Rows scattered over a shuffled pool through their page tables attend exactly as in a contiguous cache."""
  q, k, v, lengths, mask = case_inputs(*case)
  kp, vp, pages = paged(k, v, lengths, mask.shape[2], PAGE)
  run = jax.jit(lambda q, k, v, lengths, mask, pages: tree_attention.attention(q, k, v, 1, lengths, mask, impl=impl,
                                                                                block=block, pages_BxM=pages))
  got = np.asarray(run(q, kp, vp, lengths, mask, pages), np.float32)
  f32 = lambda x: np.asarray(x, np.float32)
  want = brute_force(f32(q), f32(k[1]), f32(v[1]), lengths, mask)
  np.testing.assert_allclose(got, want, atol=1e-5 if case[-1] == "float32" else 2e-2, rtol=0)


def test_the_page_size_must_be_a_multiple_of_the_block():
  q, k, v, lengths, mask = case_inputs(1, 64, 1, 0, "float32")
  kp, vp, pages = paged(k, v, lengths, 1, 8)
  with pytest.raises(ValueError, match="page size 8 is not a multiple of the attention block 16"):
    tree_attention.attention(q, kp, vp, 0, lengths, mask, impl="xla", block=BLOCK, pages_BxM=pages)


@pytest.mark.parametrize("impl", ["xla", "pallas_tpu", "pallas_gpu"])
def test_the_layer_is_a_run_time_value(impl):
  """A scanned decoder's layer index is traced: one executable reads whichever layer it is given."""
  q, k, v, lengths, mask = case_inputs(4, 64, 5, 3, "float32")
  run = jax.jit(lambda layer, q, k, v, lengths, mask: tree_attention.attention(q, k, v, layer, lengths, mask,
                                                                                impl=impl, block=BLOCK))
  for layer in (0, 1):
    got = run(jnp.int32(layer), q, k, v, lengths, mask)
    np.testing.assert_allclose(got, brute_force(q, k[layer], v[layer], lengths, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl,backend,expected", [
    ("auto", "cpu", ("xla", False)), ("auto", "tpu", ("pallas_tpu", False)), ("auto", "gpu", ("pallas_gpu", False)),
    ("pallas", "cpu", ("xla", False)), ("pallas", "gpu", ("pallas_gpu", False)), ("xla", "tpu", ("xla", False)),
    ("pallas_tpu", "cpu", ("pallas_tpu", True)), ("pallas_tpu", "tpu", ("pallas_tpu", False)),
    ("pallas_gpu", "cpu", ("pallas_gpu", True)), ("pallas_gpu", "gpu", ("pallas_gpu", False)),
    ("triton", "gpu", ("triton", False)),
])
def test_selection_by_backend(impl, backend, expected):
  assert tree_attention.select(impl, backend) == expected


def test_triton_off_a_gpu_is_refused_not_replaced():
  for backend in ("cpu", "tpu"):
    with pytest.raises(ValueError, match=f"attention='triton' needs an NVIDIA GPU .*the backend here is '{backend}'"):
      tree_attention.select("triton", backend)
  q, k, v, lengths, mask = case_inputs(1, 64, 1, 0, "float32")
  for block in (None, BLOCK):  # not even the dense reference in its place
    with pytest.raises(ValueError, match="attention='triton' needs an NVIDIA GPU"):
      tree_attention.attention(q, k, v, 0, lengths, mask, impl="triton", block=block)


def test_without_triton_the_package_works_and_the_triton_kernel_says_what_is_missing():
  """triton (the gpu extra) is imported when the kernel is first needed: the package stands without it."""
  code = ("import sys; sys.modules['triton'] = None; import numpy as np; "
          "from tlt_jax.kernels import tree_attention, triton_gpu; "
          "x, kv = np.ones((1, 1, 1, 16), np.float32), np.ones((1, 1, 16, 1, 16), np.float32); "
          "args = (x, kv, kv, 0, np.zeros(1, np.int32), np.ones((1, 1, 1), bool)); "
          "print(tree_attention.attention(*args, impl='xla', block=16).sum()); "
          "triton_gpu.tree_attention(*args, block=16, scale=1.0)")
  proc = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True, timeout=300)
  assert proc.stdout.strip() == "16.0", proc.stderr[-2000:]
  assert "ValueError: attention='triton' needs the gpu extra: pip install 'tlt_jax[gpu]'" in proc.stderr


def test_bad_implementation_and_shapes_are_named():
  q, k, v, lengths, mask = case_inputs(1, 64, 1, 0, "float32")
  with pytest.raises(ValueError, match="'cuda' is not one of"):
    tree_attention.attention(q, k, v, 0, lengths, mask, impl="cuda", block=BLOCK)
  with pytest.raises(ValueError, match="pallas_gpu needs a power-of-two head dim >= 16, got 8"):
    tree_attention.attention(q[..., :8], k[..., :8], v[..., :8], 0, lengths, mask, impl="pallas_gpu", block=BLOCK)
  with pytest.raises(ValueError, match="pallas_tpu needs an attention block that is a multiple of 16 for bfloat16"):
    tree_attention.attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), 0, lengths, mask, impl="pallas_tpu",
                             block=8)


# ---- lowering for the hardware we do not have ----
# From JAX 0.11 Pallas' Triton lowering asks the device it lowers for its compute capability; from this
# CPU host, an abstract mesh with an abstract H100 names the target (as jax.sharding.use_abstract_mesh says).
H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")


def target(platform, mesh=jax.sharding.AbstractMesh((1,), ("x",))):
  """The context to lower on `mesh` (its axes) for `platform`: for CUDA, an H100's."""
  if platform != "cuda":
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(mesh.update(abstract_device=H100))


def export(impl, platform, dtype, t, w, paged=False, q_dtype=None, block=128):
  """jax.export of the kernel at Qwen2.5-7B's attention shape (28 heads over 4 KV heads, head dim 128),
  with the layer index traced as a scanned decoder gives it; `paged`: over a pool of 256-slot pages;
  `q_dtype`: the queries' own (a float32 drafter over a bfloat16 cache)."""
  kernel = {"pallas_tpu": pallas_tpu, "pallas_gpu": pallas_gpu}[impl].tree_attention
  f = jax.jit(lambda layer, q, k, v, lengths, mask, pages=None: kernel(q, k, v, layer, lengths, mask, block=block,
                                                                       scale=0.1, pages_BxM=pages))
  b, s = 8, 1024
  kv = ((4, 20, 256, 4, 128) if paged else (4, b, s, 4, 128), dtype)
  shapes = [jax.ShapeDtypeStruct(x, y) for x, y in [((), jnp.int32), ((b, t, 28, 128), q_dtype or dtype), kv, kv,
                                                     ((b,), jnp.int32), ((b, t, w), jnp.bool_)]]
  if paged:
    shapes.append(jax.ShapeDtypeStruct((b, s // 256), jnp.int32))
  # The Triton custom call carries no cross-version stability guarantee; we only check it lowers.
  checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  with target(platform):
    return jax.export.export(f, platforms=[platform], disabled_checks=checks)(*shapes)


# A drafter level; decode; a paged verify; a float32 drafter over a bfloat16 cache (the engine's speculation
# with a bfloat16 policy: Triton multiplies only operands of one dtype, which stopped it on an H200); a
# 48-token verify at configs/r1_7b.py's block (three query tiles; slots walked 64 at a time).
@pytest.mark.parametrize("dtype,t,w,paged,q_dtype,block", [
    ("float32", 16, 24, False, None, 128), ("bfloat16", 1, 1, False, None, 128), ("bfloat16", 16, 16, True, None, 128),
    ("bfloat16", 4, 12, False, "float32", 128), ("bfloat16", 48, 48, False, None, 512)])
@pytest.mark.parametrize("impl,platform", [("pallas_tpu", "tpu"), ("pallas_gpu", "cuda")])
def test_kernels_lower_for_their_hardware(impl, platform, dtype, t, w, paged, q_dtype, block):
  exported = export(impl, platform, jnp.dtype(dtype), t, w, paged, q_dtype and jnp.dtype(q_dtype), block)
  assert exported.platforms == (platform,)
  target = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}[platform]
  assert target in exported.mlir_module()


# ---- under a multi-device mesh: one kernel call per device ----
MESH = {"data": 4, "tensor": 2}  # the 8 simulated CPU devices; rows over data, KV heads over tensor


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_kernels_under_a_mesh_match_the_reference(impl):
  q, k, v, lengths, mask = case_inputs(4, 64, 5, 3, "float32")
  with jax.set_mesh(sharding.make_mesh(MESH)):
    got = jax.jit(lambda q, k, v, lengths, mask: tree_attention.attention(q, k, v, 1, lengths, mask, impl=impl,
                                                                           block=BLOCK))(q, k, v, lengths, mask)
  np.testing.assert_allclose(got, brute_force(q, k[1], v[1], lengths, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu", "xla"])
def test_a_paged_cache_split_like_its_rows_under_a_mesh(impl):
  """Each device holds a range of the pool with its rows' pages (global indices in the tables): the
  kernels read them by local index on their device, and the reference (GSPMD) agrees."""
  q, k, v, lengths, mask = case_inputs(4, 64, 5, 3, "float32")
  kp, vp, pages = paged(k, v, lengths, mask.shape[2], PAGE, shards=MESH["data"])
  with jax.set_mesh(sharding.make_mesh(MESH)):
    got = jax.jit(lambda q, k, v, lengths, mask, pages: tree_attention.attention(
        q, k, v, 1, lengths, mask, impl=impl, block=BLOCK, pages_BxM=pages))(q, kp, vp, lengths, mask, pages)
  np.testing.assert_allclose(got, brute_force(q, k[1], v[1], lengths, mask), atol=1e-5, rtol=0)


def test_a_paged_cache_under_a_mesh_needs_rows_split_like_its_pages():
  q, k, v, lengths, mask = case_inputs(4, 64, 5, 3, "float32")
  kp, vp, pages = paged(k[:, :2], v[:, :2], lengths[:2], mask.shape[2], PAGE, shards=2)  # 2 rows on 4 devices
  with jax.set_mesh(sharding.make_mesh(MESH)):
    with pytest.raises(ValueError, match=r"needs its 2 rows split like its \d+ pages .*rollout.engine.batch_buckets"):
      tree_attention.attention(q[:2], kp, vp, 1, lengths[:2], mask[:2], impl="pallas_gpu", block=BLOCK,
                               pages_BxM=pages)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("impl,platform", [("pallas_tpu", "tpu"), ("pallas_gpu", "cuda")])
def test_kernels_lower_for_their_hardware_under_a_mesh(impl, platform, paged):
  mesh = sharding.make_mesh(MESH)
  spec = lambda *names: jax.sharding.NamedSharding(mesh, jax.P(*names))
  b, t, w, s = 8, 4, 4, 1024
  kv = (2, 4 * b + 8, 256, 4, 128) if paged else (2, b, s, 4, 128)  # paged: 4 pages per row + 2 spare per device
  shapes = [jax.ShapeDtypeStruct(shape, dtype, sharding=sh) for shape, dtype, sh in [
      ((b, t, 28, 128), jnp.bfloat16, spec("data", None, "tensor")),
      (kv, jnp.bfloat16, spec(None, "data", None, "tensor")), (kv, jnp.bfloat16, spec(None, "data", None, "tensor")),
      ((b,), jnp.int32, spec("data")), ((b, t, w), jnp.bool_, spec("data"))]]
  if paged:
    shapes.append(jax.ShapeDtypeStruct((b, s // 256), jnp.int32, sharding=spec("data")))
  kernel = {"pallas_tpu": pallas_tpu, "pallas_gpu": pallas_gpu}[impl].tree_attention
  run = lambda q, k, v, lengths, mask, pages=None: kernel(q, k, v, 1, lengths, mask, block=128, scale=0.1,
                                                           pages_BxM=pages)
  checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  with jax.set_mesh(mesh), target(platform, mesh.abstract_mesh):
    exported = jax.export.export(jax.jit(lambda *a: tree_attention.per_device(run, *a)), platforms=[platform],
                                 disabled_checks=checks)(*shapes)
    assert exported.nr_devices == 8
    if impl == "pallas_tpu":  # what per_device avoids: Mosaic does not lower over sharded operands
      with pytest.raises(NotImplementedError, match="cannot be automatically partitioned"):
        jax.export.export(jax.jit(run), platforms=[platform])(*shapes)
