"""Drafter checkpoints: the trainable params (orbax) plus `drafter_config.json` to rebuild it.

A checkpoint directory holds
  params/              orbax StandardCheckpointer save of the drafter's nnx.Param state
  drafter_config.json  feature_layers, draft_vocab (a reduced head's target ids; absent or [] = the
                       full vocabulary), dtype and the target ModelConfig it was trained for
Only the drafter's own params are stored: embedding and lm_head belong to the target. Loading
checks the target's config field by field, so a drafter never silently runs against a
different model. The directory is written under a temporary name and renamed (it replaces only
an earlier drafter checkpoint). Saving and loading involve the calling process alone (of
several, `jax.distributed`: each loads its own copy).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from tlt_jax import files
from tlt_jax.drafter.model import Drafter, check_draft_vocab
from tlt_jax.models import hf
from tlt_jax.models.config import ModelConfig

CONFIG_FILE = "drafter_config.json"
PARAMS_DIR = "params"
FORMAT_VERSION = 1


class DrafterCheckpointError(ValueError):
  """A drafter checkpoint we cannot load; the message names the file and field."""


def _target_fields(cfg: ModelConfig) -> dict[str, Any]:
  """The target's architecture; not `scan_layers` (how our decoder runs the same layers), so a
  drafter serves either form. Through JSON so tuples compare equal to the lists read back."""
  fields = dataclasses.asdict(cfg)
  del fields["scan_layers"]
  return json.loads(json.dumps(fields))


def _this_process() -> ocp.options.MultiprocessingOptions:
  me = jax.process_index()
  return ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                            barrier_sync_key_prefix=f"drafter-{me}")


def is_checkpoint(path: str) -> bool:
  """Whether the directory `path` holds a drafter checkpoint and nothing else."""
  names = set(os.listdir(path))
  return CONFIG_FILE in names and names <= {CONFIG_FILE, PARAMS_DIR}


def save_drafter(drafter: Drafter, directory: str) -> None:
  """Writes `drafter` to `directory` atomically, replacing only an empty directory or a drafter checkpoint."""
  params = nnx.state(drafter, nnx.Param)
  if jax.process_count() > 1:  # orbax saves no process-local jax.Array in a multi-process run
    params = jax.tree.map(np.asarray, params)
  config = {"format_version": FORMAT_VERSION, "feature_layers": list(drafter.feature_layers),
            "draft_vocab": list(drafter.draft_vocab),
            "dtype": drafter.fc.kernel.get_value().dtype.name, "target": _target_fields(drafter.config)}
  with files.atomic_directory(directory, "a drafter checkpoint", is_checkpoint) as tmp:
    with ocp.StandardCheckpointer(multiprocessing_options=_this_process()) as checkpointer:
      checkpointer.save(os.path.join(tmp, PARAMS_DIR), params)
    with open(os.path.join(tmp, CONFIG_FILE), "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2)


def read_drafter_config(directory: str) -> dict[str, Any]:
  """The checkpoint's `drafter_config.json`, checked for the keys loading needs."""
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"drafter directory {directory!r} does not exist")
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found: not a drafter checkpoint")
  with open(path, encoding="utf-8") as f:
    try:
      config = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
      raise DrafterCheckpointError(f"{path}: invalid JSON ({e})") from e
  for key in ("format_version", "feature_layers", "dtype", "target"):
    if key not in config:
      raise DrafterCheckpointError(f"{path}: missing key {key!r}")
  if config["format_version"] != FORMAT_VERSION:
    raise DrafterCheckpointError(f"{path}: format_version {config['format_version']!r} is not supported "
                                 f"(expected {FORMAT_VERSION})")
  if config["dtype"] not in hf.DTYPES:
    raise DrafterCheckpointError(f"{path}: dtype {config['dtype']!r} is not one of {sorted(hf.DTYPES)}")
  return config


def load_drafter(directory: str, target_config: ModelConfig) -> Drafter:
  """Rebuilds the drafter saved in `directory` for a target with `target_config`.

  Params land on the default device; `sharding.shard_model` spreads them over a mesh.
  """
  config = read_drafter_config(directory)
  path = os.path.join(directory, CONFIG_FILE)
  saved, expected = config["target"], _target_fields(target_config)
  for field in expected:
    if saved.get(field) != expected[field]:
      raise DrafterCheckpointError(
          f"{path}: the drafter was trained for a target with {field}={saved.get(field)!r}, "
          f"but this target has {field}={expected[field]!r}")
  params_dir = os.path.join(os.path.abspath(directory), PARAMS_DIR)
  if not os.path.isdir(params_dir):
    raise FileNotFoundError(f"{params_dir} not found: the drafter checkpoint has no params")
  dtype = hf.DTYPES[config["dtype"]]
  layers = tuple(config["feature_layers"])
  vocab = config.get("draft_vocab", [])
  if not isinstance(vocab, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in vocab):
    raise DrafterCheckpointError(f"{path}: draft_vocab must be a list of token ids")
  try:
    check_draft_vocab(target_config.vocab_size, vocab)
  except ValueError as e:
    raise DrafterCheckpointError(f"{path}: {e}") from None
  graphdef, abstract, rest = nnx.split(
      nnx.eval_shape(lambda: Drafter(target_config, feature_layers=layers, draft_vocab=vocab, dtype=dtype,
                                     rngs=nnx.Rngs(0))),
      nnx.Param, ...)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)
  try:
    with ocp.StandardCheckpointer(multiprocessing_options=_this_process()) as checkpointer:
      params = checkpointer.restore(params_dir, target)
  except Exception as e:  # pylint: disable=broad-exception-caught  (orbax / tensorstore raise many kinds)
    # tensorstore appends its whole spec to the message; its first part names the damage.
    raise DrafterCheckpointError(f"{params_dir}: the params do not restore "
                                 f"({type(e).__name__}: {str(e).split(' [tensorstore_spec')[0][:500]})") from None
  return nnx.merge(graphdef, params, rest)


class AsyncDrafterCheckpointer:
  """Selective background checkpoints of an online drafter: its params and optimizer state only.

  `directory/<version>/{params,opt_state,metadata}` via an orbax CheckpointManager with async
  saving: `save` returns once the arrays are copied off the devices and writes in the background.
  At most one save is pending: a new `save` first waits for the previous one. The last
  `max_to_keep` versions are kept. The policy is never written here (the RL checkpoint's job).
  """

  def __init__(self, directory: str, max_to_keep: int = 2):
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=True)
    self.manager = ocp.CheckpointManager(os.path.abspath(directory), options=options)

  def save(self, version: int, params, opt_state, metadata: dict) -> None:
    self.manager.wait_until_finished()  # at most one pending save
    self.manager.save(version, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                       opt_state=ocp.args.StandardSave(opt_state),
                                                       metadata=ocp.args.JsonSave(metadata)))

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def latest_version(self) -> int | None:
    return self.manager.latest_step()

  def restore(self, params_like, opt_state_like, version: int | None = None):
    """(params, opt_state, metadata) of `version` (default: the latest), shaped like the given trees."""
    version = self.latest_version() if version is None else version
    if version is None:
      raise FileNotFoundError(f"{self.manager.directory}: no drafter checkpoint")
    out = self.manager.restore(version, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params_like), opt_state=ocp.args.StandardRestore(opt_state_like),
        metadata=ocp.args.JsonRestore()))
    return out["params"], out["opt_state"], out["metadata"]

  def close(self) -> None:
    self.manager.close()
