"""Hardware a dry run compiles for without having it (`config.mesh.target`).

Each target is a data file here (`<name>.toml`), written from the device's published facts: its peak
dense bfloat16 FLOP/s and memory bandwidth (the roofline's), its memory, and what its compiler needs.
An NVIDIA GPU's `gpu_device_info` is an XLA GPU target config (`stream_executor.GpuTargetConfigProto`):
the CUDA plugin (`jax[cuda13]`, the `gpu` extra) compiles for it with no GPU or driver present. A TPU's
`tpu` table shapes a topology for libtpu (`jax[tpu]`, the `tpu` extra). `devices` gives compile-only
devices of either; `jax.jit(f).lower(...).compile()` over a mesh of them runs that hardware's own
compiler, as MaxText's train_compile does.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import tomllib

import jax

GB = 1 << 30
_DIR = os.path.dirname(os.path.abspath(__file__))
# The share of a GPU's memory a run lets JAX take (XLA_PYTHON_CLIENT_MEM_FRACTION, set at start-up unless the
# environment sets it; JAX's own default is 0.75): what a dry run checks against.
GPU_MEMORY_FRACTION = 0.95


@dataclasses.dataclass(frozen=True)
class Target:
  """One kind of device, from its data file."""

  key: str  # the file's name: config.mesh.target
  name: str
  platform: str  # "gpu" or "tpu"
  peak_bf16_tflops: float
  memory_bandwidth_gbps: float
  memory_gb: float
  gpu: dict | None  # the XLA GPU target config's fields
  tpu: dict | None  # generation, accelerator_type, chips_per_host, dims (2D or 3D slices), cores_per_chip

  def roofline_s(self, flops: float, nbytes: float) -> float:
    """The time an executable of `flops` and `nbytes` of memory traffic takes at best on one device."""
    return max(flops / (self.peak_bf16_tflops * 1e12), nbytes / (self.memory_bandwidth_gbps * 1e9))


def usable_gb(target: Target) -> float:
  """The memory a run has on one of `target`'s devices: a GPU's share JAX takes (XLA_PYTHON_CLIENT_MEM_FRACTION,
  else GPU_MEMORY_FRACTION), a TPU's whole HBM."""
  if target.platform != "gpu":
    return target.memory_gb
  return target.memory_gb * float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION))


def names() -> tuple[str, ...]:
  return tuple(sorted(f[:-5] for f in os.listdir(_DIR) if f.endswith(".toml")))


@functools.cache
def load(key: str) -> Target:
  """The target `key` (a data file's name); ValueError naming the known ones when there is none."""
  if key not in names():
    raise ValueError(f"unknown target {key!r}; known: {', '.join(names())}")
  with open(os.path.join(_DIR, f"{key}.toml"), "rb") as f:
    facts = tomllib.load(f)
  gpu = facts.get("gpu_device_info")
  memory_gb = gpu["device_memory_size"] / GB if gpu else facts["memory_gb"]
  return Target(key=key, name=facts["name"], platform=facts["platform"],
                peak_bf16_tflops=facts["peak_bf16_tflops"], memory_bandwidth_gbps=facts["memory_bandwidth_gbps"],
                memory_gb=memory_gb, gpu=gpu and {"gpu_device_info": gpu, **facts["target"]}, tpu=facts.get("tpu"))


def text_proto(fields: dict, indent: str = "") -> str:
  """`fields` in protobuf text format (nested tables are messages)."""
  lines = []
  for name, value in fields.items():
    if isinstance(value, dict):
      lines += [f"{indent}{name} {{", text_proto(value, indent + "  "), f"{indent}}}"]
    else:
      lines.append(f"{indent}{name}: {_proto_value(value)}")
  return "\n".join(line for line in lines if line)


def _proto_value(value) -> str:
  if isinstance(value, bool):
    return "true" if value else "false"
  return f'"{value}"' if isinstance(value, str) else repr(value)


def hosts(target: Target, count: int, processes: int) -> int:
  """Hosts `count` devices span: the config's processes, or more where the target's hosts hold fewer chips."""
  per_host = (target.tpu or {}).get("chips_per_host", count)
  return max(processes, -(-count // per_host))


def devices(target: Target, count: int, processes: int = 1) -> list[jax.Device]:
  """`count` compile-only devices of `target` over `hosts(...)` hosts (one process each). No device or driver
  is needed here: the compilers are the plugins' (`jax[cuda13]`, `jax[tpu]`)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  n_hosts = hosts(target, count, processes)
  if count % n_hosts:
    raise ValueError(f"{count} devices do not split evenly over {n_hosts} hosts")
  if target.platform == "gpu":
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"  # the plugin checks the driver's CUDA version: none here
    try:
      topology = topologies.get_topology_desc(target.key, "cuda", target_config=text_proto(target.gpu),
                                              topology=f"1x{n_hosts}x{count // n_hosts}")
    except (ImportError, RuntimeError) as e:
      raise ValueError(f"compiling for {target.key} needs the CUDA plugin (pip install 'tlt_jax[gpu]'): {e}") from e
    return list(topology.devices)
  t = target.tpu
  shape = _slice_shape(count, t["dims"])
  host = _slice_shape(count // n_hosts, t["dims"])
  cores = count * t.get("cores_per_chip", 1)
  # libtpu reads the machine's TPU environment when it loads; none here: describe the slice, skip the metadata
  # server, and let other processes load it too (it locks the chips it drives: none, compiling only).
  for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", f"{t['accelerator_type']}-{cores}"),
                     ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0"),
                     ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(key, value)
  try:
    name = f"{t['generation']}:{'x'.join(map(str, shape))}"
    topology = topologies.get_topology_desc(platform="tpu", topology_name=name, chip_config_name="default",
                                            chips_per_host_bounds=(*host, 1)[:3], num_slices=1,
                                            wrap=(False, False, False))
  except (ImportError, RuntimeError) as e:
    raise ValueError(f"compiling for {target.key} needs libtpu (pip install 'tlt_jax[tpu]'): {e}") from e
  return list(topology.devices)


def _slice_shape(chips: int, dims: int) -> tuple[int, ...]:
  """The most even 2D or 3D grid of `chips` (a power of two), smallest side first."""
  if chips & (chips - 1):
    raise ValueError(f"a TPU slice holds a power of two chips, not {chips}")
  k = int(math.log2(chips))
  sides = [k // dims + (i >= dims - k % dims) for i in range(dims)]
  return tuple(1 << s for s in sides)


def of_device_kind(kind: str) -> Target | None:
  """The target whose devices JAX calls `kind` ("NVIDIA H100 80GB HBM3", "TPU v5 lite"), or None."""
  for key in names():
    target = load(key)
    if kind == (target.gpu["device_description_str"] if target.gpu else target.tpu["device_kind"]):
      return target
  return None


def compute_capability(mesh) -> int | None:
  """The CUDA compute capability (90: sm_90) of the target whose devices `mesh` (abstract) holds, for a kernel
  compiled without its GPU (`jax_triton`); None for a GPU that is here (its own is read) or another platform."""
  device = mesh.abstract_device
  target = of_device_kind(device.device_kind) if device is not None else None
  if target is None or target.gpu is None:
    return None
  capability = target.gpu["gpu_device_info"]["cuda_compute_capability"]
  return 10 * capability["major"] + capability.get("minor", 0)
