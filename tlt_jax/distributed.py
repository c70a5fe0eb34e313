"""Cross-process pieces of multi-controller runs (`jax.distributed`; one process per host).

Every process runs the same program. What the processes must agree on while their devices are
busy with process-local work (the drafter trainer's rounds while other groups still decode, a tiny
policy trained by process 0 alone) goes through the coordination service's key-value store on
the host, never through a device collective that would queue behind that work. Arrays sharded
over several processes come to the host by a device collective (`multihost_utils`). With one
process every function here is the identity (or a no-op), so single-process runs take no detour.
"""

from __future__ import annotations

import itertools
import os
import pickle
import zlib
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.experimental.compilation_cache import compilation_cache

from tlt_jax import targets

TIMEOUT_S = 3600  # a process that does not answer by then has died or hangs: fail, don't wait forever

_calls = itertools.count()  # every process makes the same calls in the same order: the n-th call's keys match


def multiprocess() -> bool:
  return jax.process_count() > 1


def primary() -> bool:
  """Whether this process writes what is written once (metrics, exports, downloads)."""
  return jax.process_index() == 0


def _client():
  from jax._src.distributed import global_state  # pylint: disable=import-outside-toplevel
  if global_state.client is None:
    raise RuntimeError("jax.process_count() > 1 but jax.distributed is not initialized")
  return global_state.client


def allgather(value: Any, timeout_s: float = TIMEOUT_S) -> list[Any]:
  """Every process's `value` (picklable), in process order, through the key-value store (host only)."""
  if not multiprocess():
    return [value]
  client, n, me = _client(), jax.process_count(), jax.process_index()
  call = next(_calls)
  client.key_value_set_bytes(f"tlt/{call}/{me}", pickle.dumps(value))
  out = [pickle.loads(client.blocking_key_value_get_bytes(f"tlt/{call}/{p}", int(timeout_s * 1000)))
         for p in range(n)]
  if call:  # every process posted this call, so all read the previous one: drop our old value
    client.key_value_delete(f"tlt/{call - 1}/{me}")
  return out


def check_identical(tree: Any, what: str) -> None:
  """Raises naming `what` when `tree`'s values differ between processes (CRC32 of each host copy)."""
  if not multiprocess():
    return
  crc = zlib.crc32(b"".join(np.ascontiguousarray(x).tobytes() for x in jax.tree.leaves(jax.device_get(tree))))
  crcs = allgather(crc)
  if len(set(crcs)) > 1:
    raise RuntimeError(f"{what} differs between processes (CRC32 by process: {crcs})")


def barrier(name: str, timeout_s: float = TIMEOUT_S) -> None:
  """Waits until every process gets here (host only: one process may be busy computing meanwhile)."""
  if multiprocess():
    _client().wait_at_barrier(f"tlt/{name}/{next(_calls)}", int(timeout_s * 1000))


def to_host(tree: Any) -> Any:
  """NumPy copies of a pytree of arrays, some perhaps sharded over several processes' devices
  (those are gathered: a device collective, so every process calls this at the same point)."""
  def host(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(host, tree)


def setup_devices(config) -> None:
  """Simulated CPU devices, the multi-process runtime and the compilation cache of a run's config (its
  `mesh`, `distributed` and `rollout.compilation_cache_dir` keys), before any computation."""
  if config.dry_run and config.mesh.target:  # compiled for the target's devices, none of this host's needed
    jax.config.update("jax_platforms", "cpu")
  # A GPU's memory for the run (what a dry run checks against), before JAX takes its default 75% of it.
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(targets.GPU_MEMORY_FRACTION))
  cpu_devices = config.mesh.dry_run_devices if config.dry_run and not config.mesh.target else config.mesh.cpu_devices
  if cpu_devices:  # only the CPU backend's device count: on an accelerator host this changes nothing
    jax.config.update("jax_num_cpu_devices", cpu_devices)
  d = config.distributed
  if (d.enabled or _multi_host_environment()) and not config.dry_run:  # a dry run simulates the devices
    kwargs = {}
    if d.coordinator_address:  # else jax finds them in the Slurm / Kubernetes / Cloud TPU environment
      kwargs = dict(coordinator_address=d.coordinator_address, num_processes=d.num_processes, process_id=d.process_id)
    jax.distributed.initialize(**kwargs)
    logging.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
  setup_compilation_cache(config.rollout.compilation_cache_dir)


def setup_compilation_cache(path: str) -> None:
  """Points JAX's persistent compilation cache at `path` ("": leaves it as it is), caching every
  executable: later processes load what this one compiles. Process-wide: call it once at start-up."""
  previous = jax.config.jax_compilation_cache_dir
  if not path or previous == path:
    return
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  if previous:  # JAX opens the cache once per process: make it open the new dir
    compilation_cache.reset_cache()


def _multi_host_environment() -> bool:
  return int(os.environ.get("SLURM_NTASKS", "1")) > 1 or "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
