"""RL checkpoints: orbax CheckpointManager (async, keep-N) over arrays + JSON metadata.

A checkpoint at step s holds `arrays` (policy params + optimizer state, drafter + its optimizer
state, ...: any pytree of arrays) and `meta` (JSON: data position, bandit state, drafter version,
...). orbax writes each step to a temporary directory and renames it when complete, so a run
killed mid-save leaves the previous checkpoint as the latest one (the temporary directory is
removed, with a note, when the next run opens the manager). A save first checks that the
filesystem has room for it (the newest checkpoint's size, plus a margin): a full disk stops the
run with an OSError naming the directory and the space needed, before a write fails halfway (a
write that fails all the same, the disk filling during it, is an OSError too). A complete-looking
step that does not restore (a truncated or garbled array file, missing metadata) is skipped with a
warning naming it and the step before it restored (`restore_latest`).

The arrays' shapes may depend on the metadata (the drafter's data buffer grows and shrinks): then
`restore` takes a function from the metadata to the arrays' shapes and reads the metadata first.

Several processes (`jax.distributed`): every process calls save and restore (orbax writes each
array's shards once and the metadata from process 0). Arrays that live on one process's devices
only (the online drafter trainer's drafter: an identical copy on every process) are saved as one array
replicated over all devices and restored onto the devices they came from. Data that differs by
process (each process's own drafter buffer) goes in as `stack_processes` arrays: one row per
process, written by its process, read back by it (`unstack_processes`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from tlt_jax import distributed


def _process_local(x) -> bool:
  return distributed.multiprocess() and isinstance(x, jax.Array) and x.is_fully_addressable


def _everywhere() -> NamedSharding:
  return NamedSharding(jax.make_mesh((jax.device_count(),), ("all",), devices=jax.devices()), P())


def _process_rows() -> NamedSharding:
  """Axis 0 over the processes, axis 1 over each process's own devices: row p lies on process p."""
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  grid = np.asarray(devices, dtype=object).reshape(jax.process_count(), -1)
  return NamedSharding(jax.sharding.Mesh(grid, ("process", "local")), P("process", "local"))


def stack_processes(local: dict[str, np.ndarray]) -> tuple[dict[str, jax.Array], dict]:
  """Each process's own `local` arrays as orbax-saveable global arrays, and their spec (JSON).

  Key k (an array of one or more axes) becomes one array [process_count, *dims] whose row p is
  process p's array, zero-padded to the largest shape any process has (axis 1 to a multiple of
  the local device count, which it is split over: no device holds more than its share; every
  axis at least 1, as orbax keeps no empty arrays). The spec holds every process's true shapes
  and the dtypes, for `stacked_like` and `unstack_processes`. Every process calls this (it
  exchanges the shapes).
  """
  shapes = distributed.allgather({k: list(x.shape) for k, x in local.items()})
  # The dtype of the processes that hold data (an empty array's dtype may be a placeholder's).
  kinds = distributed.allgather({k: jnp.dtype(x.dtype).name for k, x in local.items() if x.size})
  sharding = _process_rows()
  per_device = sharding.mesh.shape["local"]
  arrays, dtypes = {}, {}
  for k, x in local.items():
    dims = [max([1] + [s[k][i] for s in shapes]) for i in range(x.ndim)]
    dims[0] = -(-dims[0] // per_device) * per_device
    dtypes[k] = next((kind[k] for kind in kinds if k in kind), jnp.dtype(x.dtype).name)
    row = np.zeros([1, *dims], jnp.dtype(dtypes[k]))
    row[(0, *(slice(0, n) for n in x.shape))] = x
    arrays[k] = jax.make_array_from_process_local_data(sharding, row, (jax.process_count(), *dims))
  return arrays, {"shapes": shapes, "dtypes": dtypes, "padded": {k: list(a.shape[1:]) for k, a in arrays.items()}}


def stacked_like(spec: dict) -> dict[str, jax.ShapeDtypeStruct] | None:
  """The shapes of what `stack_processes` returned with `spec`, to restore it; None when another
  layout of processes and devices wrote it (its rows belong to processes this run does not have)."""
  sharding = _process_rows()
  if len(spec["shapes"]) != jax.process_count() or any(
      dims[0] % sharding.mesh.shape["local"] for dims in spec["padded"].values()):
    return None
  return {k: jax.ShapeDtypeStruct((jax.process_count(), *dims), jnp.dtype(spec["dtypes"][k]), sharding=sharding)
          for k, dims in spec["padded"].items()}


def unstack_processes(arrays: dict[str, jax.Array], spec: dict) -> dict[str, np.ndarray]:
  """This process's arrays out of `stack_processes` ones (as restored from a checkpoint)."""
  mine = spec["shapes"][jax.process_index()]
  out = {}
  for k, x in arrays.items():
    shards = sorted(x.addressable_shards, key=lambda s: s.index[1].start or 0)  # axis 1 over this process's devices
    row = np.concatenate([np.asarray(s.data)[0] for s in shards])
    out[k] = row[tuple(slice(0, n) for n in mine[k])]
  return out


_MARGIN_BYTES = 1 << 20  # beyond a checkpoint's size: the step's metrics and TensorBoard events


def _megabytes(n: float) -> str:
  return f"{n / 1e6:.1f} MB"


def _bytes_in(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names)


def _no_space(e: Exception) -> bool:
  """Whether `e` (an OSError, or orbax's ValueError from tensorstore) says the disk is full."""
  return getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e)


class Checkpoints:

  def __init__(self, directory: str, every: int, keep: int):
    self.directory = os.path.abspath(directory)
    if os.path.isdir(self.directory):
      for name in sorted(os.listdir(self.directory)):
        if name.endswith(".orbax-checkpoint-tmp"):
          logging.warning("removing %s: a checkpoint whose write did not finish (the run was stopped during it)",
                          os.path.join(self.directory, name))
    self.manager = ocp.CheckpointManager(
        self.directory, item_names=("arrays", "meta"),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every,
                                             enable_async_checkpointing=True, cleanup_tmp_directories=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def due(self, step: int) -> bool:
    """Whether `save(step, ...)` would write (every N steps): callers build costly state only then."""
    return self.manager.should_save(step)

  def save(self, step: int, arrays: Any, meta: dict, force: bool = False) -> bool:
    """Starts a background save if `step` is due (every N steps, or `force`); returns whether it did."""
    if not (force or self.manager.should_save(step)):
      return False
    self._check_room(step, arrays)
    arrays = jax.tree.map(lambda x: jax.device_put(np.asarray(x), _everywhere()) if _process_local(x) else x, arrays)
    with self._disk_errors(step):
      return self.manager.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                                             meta=ocp.args.JsonSave(meta)), force=force)

  def _check_room(self, step: int, arrays: Any) -> None:
    """Raises OSError (ENOSPC) on every process when the filesystem lacks room for checkpoint `step`: the
    newest checkpoint's size (else the arrays'), 10% and a megabyte more."""
    newest = self.manager.latest_step()
    size = _bytes_in(os.path.join(self.directory, str(newest))) if newest is not None else \
        sum(x.nbytes for x in jax.tree.leaves(arrays))
    need = int(1.1 * size) + _MARGIN_BYTES
    os.makedirs(self.directory, exist_ok=True)
    free = shutil.disk_usage(self.directory).free
    if any(distributed.allgather(free < need)):
      raise OSError(errno.ENOSPC, f"no space left on device for checkpoint {step} in {self.directory}: it needs "
                                  f"about {_megabytes(need)}, {_megabytes(free)} free there (free some, or lower "
                                  "checkpoint.keep, then resume)")

  @contextlib.contextmanager
  def _disk_errors(self, step: int | None):
    """orbax's failures for want of space, as one OSError naming the directory."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except  (orbax wraps tensorstore's errors in ValueErrors)
      if not _no_space(e):
        raise
      what = f"checkpoint {step}" if step is not None else "a checkpoint"
      raise OSError(errno.ENOSPC, f"no space left on device writing {what} in {self.directory} "
                                  f"({_megabytes(shutil.disk_usage(self.directory).free)} free there); the newest "
                                  "complete checkpoint is intact: free some space, then resume") from None

  def restore(self, step: int, abstract_arrays: Any | Callable[[dict], Any]) -> tuple[Any, dict]:
    """Arrays shaped and sharded like `abstract_arrays` (ShapeDtypeStructs or arrays; or a function
    of the metadata returning them), and the metadata."""
    meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if not isinstance(meta, dict):
      raise ValueError(f"no metadata ({meta!r})")
    like = abstract_arrays(meta) if callable(abstract_arrays) else abstract_arrays
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_everywhere())
                            if _process_local(x) else ocp.utils.to_shape_dtype_struct(x), like)
    out = self.manager.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract)))
    arrays = jax.tree.map(lambda x, l: jax.device_put(np.asarray(x), l.sharding) if _process_local(l) else x,
                          out["arrays"], like)
    return arrays, meta

  def restore_latest(self, abstract_arrays: Any | Callable[[dict], Any]) -> tuple[int, Any, dict] | None:
    """(step, arrays, meta) of the newest checkpoint that restores; None if there are none.

    Steps newer than it that fail to restore are skipped with a warning naming them and moved
    aside (later saves of those step numbers must not collide). If no step restores, nothing
    is moved and the error names every one: that is a config that does not match the
    checkpoints (or all of them damaged), not something to train over.
    """
    failed = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      path = os.path.join(self.directory, str(step))
      try:
        arrays, meta = self.restore(step, abstract_arrays)
      except Exception as e:  # pylint: disable=broad-except  # any damage: try the step before
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        logging.warning("checkpoint %s does not restore (%s); trying the one before", path, why)
        failed.append((path, why))
        continue
      for bad, _ in failed:
        aside = f"{bad}.corrupt-{int(time.time())}"
        logging.warning("skipped damaged checkpoint %s (moved to %s); resuming from %s", bad, aside, path)
        if jax.process_index() == 0:
          os.rename(bad, aside)
      if failed:
        self.manager.reload()
      return step, arrays, meta
    if failed:
      raise ValueError(f"no checkpoint in {self.directory} restores (does the config match the run that wrote "
                       "them?); move them away to start over:\n" + "\n".join(f"  {p}: {w}" for p, w in failed))
    return None

  def wait(self) -> None:
    with self._disk_errors(None):
      self.manager.wait_until_finished()

  def close(self) -> None:
    with self._disk_errors(None):
      self.manager.close()
