"""Targets: the data files load, and give devices the GPU's and the TPU's own compilers compile for
(the CUDA plugin and libtpu, both in the test extra), with no device here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tlt_jax import targets

GPUS = ("a100-80gb", "h100", "h200", "l4")
TPUS = ("tpu-v5e", "tpu-v5p", "tpu-v6e")


def test_every_target_has_its_facts():
  assert targets.names() == tuple(sorted(GPUS + TPUS))
  for key in targets.names():
    t = targets.load(key)
    assert t.platform == ("gpu" if key in GPUS else "tpu") and t.key == key
    assert 100 <= t.peak_bf16_tflops <= 1000 and 300 <= t.memory_bandwidth_gbps <= 5000 and 15 < t.memory_gb < 150
  h100 = targets.load("h100")
  assert round(h100.memory_gb, 1) == 79.1 and h100.gpu["gpu_device_info"]["shared_memory_per_block_optin"] == 232448
  # The slower of compute and memory: 989.4 TFLOP in a second, or 3.35 TB.
  assert h100.roofline_s(989.4e12, 1.0) == pytest.approx(1.0)
  assert h100.roofline_s(1.0, 3352.32e9) == pytest.approx(1.0)
  with pytest.raises(ValueError, match="unknown target 'h800'; known: a100-80gb, h100, h200, l4, tpu-v5e"):
    targets.load("h800")


def test_a_run_has_the_share_of_a_gpu_jax_takes(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  h100, v5p = targets.load("h100"), targets.load("tpu-v5p")
  assert targets.usable_gb(h100) == pytest.approx(0.95 * h100.memory_gb) and targets.usable_gb(v5p) == 95.0
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  assert targets.usable_gb(h100) == pytest.approx(h100.memory_gb / 2)


def test_a_gpu_target_config_is_xla_s_text_format():
  text = targets.text_proto(targets.load("l4").gpu)
  assert "gpu_device_info {\n  threads_per_block_limit: 1024\n" in text
  assert "  cuda_compute_capability {\n    major: 8\n    minor: 9\n  }\n" in text
  assert 'device_description_str: "NVIDIA L4"' in text and "clock_rate_ghz: 2.04" in text


@pytest.mark.parametrize("key, count, processes, kind, hosts", [
    ("h100", 8, 1, "NVIDIA H100 80GB HBM3", 1), ("h200", 8, 2, "NVIDIA H200", 2),
    ("a100-80gb", 2, 1, "NVIDIA A100-SXM4-80GB", 1), ("l4", 1, 1, "NVIDIA L4", 1),
    ("tpu-v5e", 8, 1, "TPU v5 lite", 1), ("tpu-v5p", 8, 1, "TPU v5", 2), ("tpu-v6e", 32, 1, "TPU v6 lite", 4)])
def test_devices_of_each_target_over_its_hosts(key, count, processes, kind, hosts):
  """A TPU host holds at most its chips (v5p: 4, v5e / v6e: 8): more chips take more hosts."""
  devices = targets.devices(targets.load(key), count, processes)
  assert len(devices) == count and {d.device_kind for d in devices} == {kind}
  assert len({d.process_index for d in devices}) == hosts
  assert {d.platform for d in devices} == {"gpu" if key in GPUS else "tpu"}


def test_the_target_compilers_compile_and_refuse():
  """A sharded gradient compiles for 2 H100s and 4 TPU v5e chips, each compiler giving its memory and FLOPs; a
  Pallas kernel whose block the GPU's shared memory cannot hold is refused by the GPU's compiler."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=import-outside-toplevel
  from tlt_jax import dry_run  # pylint: disable=import-outside-toplevel
  loss = lambda x, w: jnp.tanh(x @ w).sum()
  for key, count in (("h100", 2), ("tpu-v5e", 4)):
    mesh = Mesh(np.array(targets.devices(targets.load(key), count)), ("data",))
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    compiled = jax.jit(jax.grad(loss, argnums=1)).lower(x, w).compile()
    flops, nbytes = dry_run.cost(compiled)
    # Each device's share: 256 / count rows through the matmul and its gradient's (2 x 2 x rows x 512 x 512).
    assert flops >= 4 * 256 // count * 512 * 512 and nbytes >= 512 * 512 * 2
  device = targets.devices(targets.load("h100"), 1)[0]
  mesh = Mesh(np.array([device]), ("x",))
  one = NamedSharding(mesh, P())

  def matmul(x_ref, y_ref, o_ref):  # two 512 x 512 float32 operands: 2 MB of shared memory, an H100 has 227 KB
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...])
  block = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=one)
  big = pl.pallas_call(matmul, out_shape=jax.ShapeDtypeStruct((512, 512), jnp.float32),
                       compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))
  # Under the mesh, as the engine compiles its kernels: JAX 0.11's Pallas reads the GPU's kind from it.
  with pytest.raises(Exception, match="Shared memory size limit exceeded"), jax.set_mesh(mesh):
    jax.jit(big).lower(block, block).compile()


def test_a_compiled_kernel_reads_its_target_s_compute_capability():
  mesh = Mesh(np.array(targets.devices(targets.load("l4"), 1)), ("x",))
  assert targets.compute_capability(mesh.abstract_mesh) == 89
  assert targets.compute_capability(jax.make_mesh((1,), ("x",)).abstract_mesh) is None  # the CPU: none
  assert targets.of_device_kind("NVIDIA H200").key == "h200" and targets.of_device_kind("TPU v5 lite").key == "tpu-v5e"
  assert targets.of_device_kind("cpu") is None
