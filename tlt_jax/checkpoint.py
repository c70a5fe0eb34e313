"""RL checkpoints: orbax CheckpointManager (async, keep-N) over arrays + JSON metadata.

A checkpoint at step s holds `arrays` (policy params + optimizer state, drafter + its optimizer
state, ...: any pytree of arrays) and `meta` (JSON: data position, bandit state, drafter version,
...). orbax writes each step to a temporary directory and renames it when complete, so a run
killed mid-save leaves the previous checkpoint as the latest one.

Several processes (`jax.distributed`): every process calls save and restore (orbax writes each
array's shards once and the metadata from process 0). Arrays that live on one process's devices
only (the spot trainer's drafter: an identical copy on every process) are saved as one array
replicated over all devices and restored onto the devices they came from.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
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
                                             enable_async_checkpointing=True))

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
    arrays = jax.tree.map(lambda x, like: jax.device_put(np.asarray(x), like.sharding) if _process_local(like) else x,
                          out["arrays"], abstract_arrays)
    return arrays, out["meta"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
