"""RL checkpoints: orbax CheckpointManager (async, keep-N) over arrays + JSON metadata.

A checkpoint at step s holds `arrays` (policy params + optimizer state, drafter + its optimizer
state, ...: any pytree of arrays) and `meta` (JSON: data position, bandit state, drafter version,
...). orbax writes each step to a temporary directory and renames it when complete, so a run
killed mid-save leaves the previous checkpoint as the latest one (the temporary directory is
removed when the next run opens the manager). A complete-looking step that does not restore
(a truncated or garbled array file, missing metadata) is skipped with a warning naming it and
the step before it restored (`restore_latest`).

Several processes (`jax.distributed`): every process calls save and restore (orbax writes each
array's shards once and the metadata from process 0). Arrays that live on one process's devices
only (the spot trainer's drafter: an identical copy on every process) are saved as one array
replicated over all devices and restored onto the devices they came from.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from tlt_jax import distributed


def _process_local(x) -> bool:
  return distributed.multiprocess() and isinstance(x, jax.Array) and x.is_fully_addressable


def _everywhere() -> NamedSharding:
  return NamedSharding(jax.make_mesh((jax.device_count(),), ("all",), devices=jax.devices()), P())


class Checkpoints:

  def __init__(self, directory: str, every: int, keep: int):
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory, item_names=("arrays", "meta"),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every,
                                             enable_async_checkpointing=True, cleanup_tmp_directories=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, arrays: Any, meta: dict, force: bool = False) -> bool:
    """Starts a background save if `step` is due (every N steps, or `force`); returns whether it did."""
    if not (force or self.manager.should_save(step)):
      return False
    arrays = jax.tree.map(lambda x: jax.device_put(np.asarray(x), _everywhere()) if _process_local(x) else x, arrays)
    return self.manager.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                                           meta=ocp.args.JsonSave(meta)), force=force)

  def restore(self, step: int, abstract_arrays: Any) -> tuple[Any, dict]:
    """Arrays shaped and sharded like `abstract_arrays` (ShapeDtypeStructs or arrays), and the metadata."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_everywhere())
                            if _process_local(x) else ocp.utils.to_shape_dtype_struct(x), abstract_arrays)
    out = self.manager.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract),
                                                             meta=ocp.args.JsonRestore()))
    if not isinstance(out["meta"], dict):
      raise ValueError(f"no metadata ({out['meta']!r})")
    arrays = jax.tree.map(lambda x, like: jax.device_put(np.asarray(x), like.sharding) if _process_local(like) else x,
                          out["arrays"], abstract_arrays)
    return arrays, out["meta"]

  def restore_latest(self, abstract_arrays: Any) -> tuple[int, Any, dict] | None:
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
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
