"""RL checkpoints: orbax CheckpointManager (async, keep-N) over arrays + JSON metadata.

A checkpoint at step s holds `arrays` (policy params + optimizer state, drafter + its optimizer
state, ...: any pytree of arrays) and `meta` (JSON: data position, bandit state, drafter version,
...). orbax writes each step to a temporary directory and renames it when complete, so a run
killed mid-save leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


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
    return self.manager.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                                           meta=ocp.args.JsonSave(meta)), force=force)

  def restore(self, step: int, abstract_arrays: Any) -> tuple[Any, dict]:
    """Arrays shaped and sharded like `abstract_arrays` (ShapeDtypeStructs or arrays), and the metadata."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_arrays)
    out = self.manager.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract),
                                                             meta=ocp.args.JsonRestore()))
    return out["arrays"], out["meta"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
