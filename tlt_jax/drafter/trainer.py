"""The online drafter trainer: ONE master drafter updated by synchronous data-parallel rounds over
device groups (tlt_jax.rollout.tlt runs them on the groups that finished their share of a rollout).

A round computes one gradient per group on its own devices from its own buffer batch, averages them
weighted by pairs and applies ONE optimizer update to the master drafter (on the first group's
devices): one drafter, never per-worker replicas that drift apart. The trainer owns the drafter's
params, optimizer state and version, its last finite state (a drafter whose params or outputs turn
non-finite goes back to it, with a warning), async selective checkpoints of each new version
(`checkpoint_dir`), and the executables (every group's gradient step, the update, the held-out
evaluation), compiled once before the first rollout decodes.

Several processes (`jax.distributed`): every process keeps an identical copy of the master drafter
and trains its own groups on its own buffer; each round the processes exchange their gradients
(host copies through tlt_jax.distributed) and each applies the same pair-weighted mean, in group
order, to its copy.

Batches draw from a generator of (seed, RL step, round, group), not one carried along, so the
state (`state_dict`: params, optimizer, data buffer; version and RL step) is all the next updates
depend on: a resumed run trains the drafter as an uninterrupted one would, given the same rounds.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from tlt_jax import checkpoint as rl_checkpoint
from tlt_jax import distributed, fields, sharding
from tlt_jax.drafter import checkpoint, train
from tlt_jax.drafter.buffer import DataBuffer
from tlt_jax.drafter.model import Drafter
from tlt_jax.executables import ExecutablePool
from tlt_jax.models.transformer import CausalLM


@dataclasses.dataclass(frozen=True)
class DrafterTrainerConfig:
  """The online drafter's updates. Config: `drafter.trainer` (seed: `seed`; temperature:
  `rollout.sampling.temperature`; `eval_rows` and `checkpoint_dir` keep their defaults in a run)."""

  learning_rate: float = 1e-3
  warmup_steps: int = 20  # linear warmup: a fresh Adam's first steps would jolt a pre-trained drafter
  rows_per_device: int = 2  # packed rows per device in a gradient step
  row_len: int = 128  # pairs per packed row
  eval_rows: int = 8  # packed rows of held-out samples for drafter/top1
  draft_steps: int = 0  # training-time test steps per update (`train.loss_fn`; 0: `train.sampling_draft_steps`)
  temperature: float = 0.0  # the rollout's: the loss's distribution term at it (`train.sampling_loss`)
  seed: int = 0
  checkpoint_dir: str | None = None  # async selective checkpoints (params + optimizer) of each new version

  def __post_init__(self):
    fields.at_least(self, 1, "rows_per_device", "eval_rows")
    fields.at_least(self, 2, "row_len")  # a pair needs a token and the next
    fields.at_least(self, 0, "learning_rate", "warmup_steps", "temperature", "draft_steps")


@dataclasses.dataclass
class Round:
  """One synchronous drafter update over the groups in `groups`."""

  start: float
  end: float
  groups: tuple[int, ...]
  metrics: dict[str, float]


class DrafterTrainer:
  """The master drafter and its updates (module docstring)."""

  def __init__(self, policy: CausalLM, drafter: Drafter, meshes: Sequence[Mesh], groups: Sequence[int],
               buffer: DataBuffer, config: DrafterTrainerConfig = DrafterTrainerConfig(),
               publish: Callable[[], None] = lambda: None):
    """The master drafter, its optimizer and its compiled steps (compiled at the first `compile`).

    Args:
      policy: the target model (its config and structure; params come with each call).
      drafter: the initial drafter (EAGLE: its features are the last hidden state).
      meshes: every rollout group's device mesh, by global group index.
      groups: the groups this process runs; the master drafter lives on the first one's devices.
      buffer: this process's captured features, batched for the rounds.
      config: learning rate, batch shapes, seed, checkpoint directory.
      publish: called whenever the master params change outside a step's rounds (a new version, a
        restore, a load): the rollout pushes them to its engines.
    """
    if drafter.feature_layers:
      raise ValueError(f"online training of EAGLE-3 drafters (feature_layers={drafter.feature_layers}) is not "
                       "supported: the engine captures only the last hidden state")
    if config.checkpoint_dir and distributed.multiprocess():
      raise ValueError("drafter trainer checkpoint_dir (selective drafter checkpoints) is single-process only")
    self.config, self.buffer, self.meshes, self.groups = config, buffer, list(meshes), list(groups)
    self.publish = publish
    self.home = self.groups[0]
    self.graphdef = nnx.graphdef(drafter)
    self.optimizer = train.make_optimizer(optax.linear_schedule(0.0, config.learning_rate,
                                                                max(config.warmup_steps, 1)))
    loss = train.sampling_loss(config.temperature)
    self._grad = train.make_grad_step(drafter, policy, train.sampling_draft_steps(config.draft_steps,
                                                                                  config.temperature), **loss)
    self._eval = train.make_eval_step(drafter, policy, **loss)
    self._all_finite = jax.jit(
        lambda tree: jnp.all(jnp.asarray([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)])))
    self._hidden = (policy.config.hidden_size, policy.dtype)
    self.params = self.on_group(self.home, nnx.state(drafter))
    self._home = sharding.param_shardings(self.params, self.meshes[self.home])
    # A dry run's drafter is shapes: so is its optimizer state, and no finite state is kept.
    init = jax.eval_shape if sharding.abstract(self.params) else lambda f, x: f(x)
    # AdamW's moments sharded like the params (over a tensor-parallel group's devices), as the update keeps them.
    self._opt_shardings = sharding.optimizer_shardings(self.optimizer, self.params)
    self.opt_state = sharding.place(init(self.optimizer.init, self.params), self._opt_shardings)
    self._apply = jax.jit(lambda p, s, g: train.apply_gradients(self.optimizer, p, s, g), donate_argnums=(0, 1),
                          out_shardings=(self._home, self._opt_shardings))
    self.version = 0
    self.rl_step = -1
    self.pool = ExecutablePool()
    self._checkpointer = checkpoint.AsyncDrafterCheckpointer(config.checkpoint_dir) if config.checkpoint_dir else None
    self._good = None if sharding.abstract(self.params) or not self.finite() else self._snapshot()

  # ---- placement ----

  def on_group(self, g: int, state: nnx.State, alias: bool = False) -> nnx.State:
    """`state` on group g's devices: a copy (the drafter's update donates its master params), or with `alias`
    the arrays themselves where they are laid out so already."""
    return sharding.place(state, sharding.param_shardings(state, self.meshes[g]), alias=alias)

  def _rows(self, g: int) -> int:
    """Group g's rows: rows_per_device on each of the devices its rows split over (a tensor-parallel
    group's devices share its rows)."""
    shape = self.meshes[g].shape
    return self.config.rows_per_device * math.prod(shape.get(a, 1) for a in sharding.BATCH_AXES)

  def _batch_sharding(self, g: int, pairs: train.Pairs):
    return jax.tree.map(lambda x: sharding.array_sharding(x.shape, ("batch",) + (None,) * (x.ndim - 1),
                                                          self.meshes[g]), pairs)

  def model(self) -> Drafter:
    """The drafter with the master params."""
    return nnx.merge(self.graphdef, self.params)

  # ---- finite states ----

  def finite(self) -> bool:
    return bool(self._all_finite(self.params))

  def _snapshot(self) -> tuple:
    return (self.on_group(self.home, self.params),
            sharding.place(self.opt_state, self._opt_shardings), self.version)

  def restore_good(self, why: str) -> bool:
    """Back to the last finite state (a copy of it, published), logging `why`; False when there is none."""
    if self._good is None:
      logging.warning("drafter: %s, and there is no finite drafter state to restore", why)
      return False
    params, opt_state, self.version = self._good
    self.params = self.on_group(self.home, params)
    self.opt_state = sharding.place(opt_state, self._opt_shardings)
    self.publish()
    logging.warning("drafter: %s; restored its last finite state (version %d)", why, self.version)
    return True

  # ---- compiled once ----

  def _abstract_pairs(self, rows: int) -> train.Pairs:
    h, dtype = self._hidden
    i32, f32 = np.int32, np.float32
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
    t = self.config.row_len
    return train.Pairs(tokens=s((rows, t), i32), positions=s((rows, t), i32), segments=s((rows, t), i32),
                       weights=s((rows, t), f32), hidden=s((rows, t, h), dtype), aux=(),
                       next_hidden=s((rows, t, h), dtype))

  def compile(self, policy_params: Mapping[int, nnx.State]) -> None:
    """Compiles every executable into `pool` (once) for the policy params on each of this process's groups:
    each group's gradient step, the pair-weighted sum of the groups' gradients, the update and the
    held-out evaluation."""
    shaped = lambda tree, shardings: jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings)
    like = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    for g in self.groups:
      pairs = self._abstract_pairs(self._rows(g))
      self.pool.get_or_compile(("grad", g), lambda: self._grad.lower(
          like(self.on_group(g, self.params)), like(policy_params[g]),
          shaped(pairs, self._batch_sharding(g, pairs))).compile())
    params, weight = like(self.params), jax.ShapeDtypeStruct((), jnp.float32)
    self.pool.get_or_compile("apply", lambda: self._apply.lower(params, like(self.opt_state), params).compile())
    self.pool.get_or_compile("scale", lambda: _scale.lower(params, weight).compile())
    self.pool.get_or_compile("accumulate", lambda: _accumulate.lower(params, params, weight).compile())
    pairs = self._abstract_pairs(self.config.eval_rows)
    self.pool.get_or_compile("eval", lambda: self._eval.lower(
        params, like(policy_params[self.home]), shaped(pairs, self._batch_sharding(self.home, pairs))).compile())

  # ---- one RL step ----

  def next_step(self) -> int:
    """Starts the next RL step (its samples enter the buffer under this number); returns it."""
    self.rl_step += 1
    return self.rl_step

  def trainable(self) -> bool:
    """Whether the buffer holds samples to train on."""
    return bool(self.buffer.training_entries())

  def batch(self, g: int, round_index: int) -> train.Pairs:
    """Group g's batch of this step's round `round_index`. Its draws come from a generator of
    (seed, RL step, round, group), not one carried across steps: nothing to checkpoint, and the
    processes of a multi-process run draw independently."""
    rng = np.random.default_rng([self.config.seed, self.rl_step, round_index, g])
    return self.buffer.batch(rng, self._rows(g), self.config.row_len)

  def round(self, groups: tuple[int, ...], batches: Mapping[int, train.Pairs],
            policy_params: Mapping[int, nnx.State]) -> Round:
    """One synchronous update: a gradient per group on its devices, pair-weighted mean, one apply.

    `batches` holds this process's groups among `groups` (their policy params in `policy_params`);
    the others' gradients come from their processes (host copies), and every process sums them in
    the same order. Returns the round's times and its pair-weighted loss and top-1.
    """
    t0, compiled = time.perf_counter(), self.pool
    local = {}
    for g, batch in batches.items():  # dispatched without waiting: the groups compute in parallel
      params = jax.device_put(self.params, sharding.param_shardings(self.params, self.meshes[g]))
      local[g] = compiled["grad", g](params, policy_params[g], jax.device_put(batch, self._batch_sharding(g, batch)))
    if distributed.multiprocess():  # leaves only (host copies); every process compiled the same output tree
      tree = compiled["grad", self.home].out_tree
      for part in distributed.allgather({g: jax.device_get(jax.tree.leaves(out)) for g, out in local.items()}):
        for g, leaves in part.items():
          local.setdefault(g, jax.tree.unflatten(tree, leaves))
    outs = [local[g] for g in groups]
    weights = np.asarray([float(m["pairs"]) for _, m in outs])
    total = max(weights.sum(), 1.0)
    grads = None  # the pair-weighted mean, by executables compiled ahead (however many groups a round holds)
    for w, (g, _) in zip(weights, outs):
      g, w = jax.device_put(g, self._home), np.float32(w / total)
      grads = compiled["scale"](g, w) if grads is None else compiled["accumulate"](grads, g, w)
    self.params, self.opt_state = compiled["apply"](self.params, self.opt_state, grads)
    metrics = {k: float(np.dot(weights, [float(m[k]) for _, m in outs]) / total) for k in ("loss", "top1")}
    jax.block_until_ready(self.params)
    return Round(t0, time.perf_counter(), groups, {**metrics, "pairs": float(weights.sum())})

  def end_step(self, trained: bool, fault: str | None = None) -> tuple[bool, float]:
    """After a step's rounds: back to the last finite state on `fault` (e.g. an engine's drafter
    outputs turned non-finite) or when training made the params non-finite; else, when `trained`,
    a new version, published, kept as the last finite state and checkpointed in the background.

    Returns (restored, seconds the step waited for the checkpoint).
    """
    if fault is None and trained and not self.finite():
      fault = "training made its params non-finite"
    if fault is not None:
      self.restore_good(fault)
      return True, 0.0
    if not trained:
      return False, 0.0
    self.version += 1
    self.publish()
    self._good = self._snapshot()
    if self._checkpointer is None:
      return False, 0.0
    t0 = time.perf_counter()
    self._checkpointer.save(self.version, self.params, self.opt_state, self.metadata())
    return False, time.perf_counter() - t0  # the write goes on in the background

  def evaluate(self, policy_params: nnx.State) -> dict[str, float]:
    """drafter/eval_loss and drafter/top1 (top1_2, top1_3: the second and third draft steps') on this
    process's held-out samples (none yet: {}), with the policy params on the home group."""
    held = self.buffer.eval_batch(self.config.eval_rows, self.config.row_len)
    if held is None:
      return {}
    held = jax.device_put(held, self._batch_sharding(self.home, held))
    m = self.pool["eval"](self.params, policy_params, held)
    return {"drafter/eval_loss": float(m["loss"]), "drafter/top1": float(m["top1"]),
            **{f"drafter/top1_{k}": float(m[f"top1_{k}"]) for k in range(2, train.EVAL_STEPS + 1)}}

  # ---- checkpoints ----

  def metadata(self) -> dict:
    return {"version": self.version, "rl_step": self.rl_step, "buffer": self.buffer.metadata()}

  def state_dict(self) -> tuple[dict, dict]:
    """(orbax-saveable pytree: drafter params, optimizer state and data buffer; JSON-able metadata).
    Every process calls it at the same point (the buffers' shapes are exchanged)."""
    local, buffer_meta = self.buffer.state_dict()
    buffer, spec = rl_checkpoint.stack_processes(local)
    metadata = {**self.metadata(), "buffer_state": {"arrays": spec, "processes": distributed.allgather(buffer_meta)}}
    return {"params": self.params, "opt_state": self.opt_state, "buffer": buffer}, metadata

  def abstract_state(self, metadata: dict) -> dict:
    """The shapes of the tree `state_dict` returned with `metadata`, to restore it. Without the
    buffer when the checkpoint has none this run can read (`load_state_dict` says so)."""
    tree = {"params": self.params, "opt_state": self.opt_state}
    buffer = rl_checkpoint.stacked_like(metadata["buffer_state"]["arrays"]) if "buffer_state" in metadata else None
    return tree if buffer is None else {**tree, "buffer": buffer}

  def load_state_dict(self, tree: dict, metadata: dict) -> None:
    """Restores what `state_dict` returned and publishes it (non-finite params: the last finite state)."""
    for key in ("params", "opt_state"):
      if key not in tree:
        raise KeyError(f"drafter trainer state has no {key!r}")
    for key in ("version", "rl_step"):
      if key not in metadata:
        raise KeyError(f"drafter trainer metadata has no {key!r}")
    self.rl_step = int(metadata["rl_step"])
    if "buffer" in tree:
      state = metadata["buffer_state"]
      self.buffer.load_state_dict(rl_checkpoint.unstack_processes(tree["buffer"], state["arrays"]),
                                  state["processes"][jax.process_index()])
    else:
      logging.warning("drafter: the checkpoint's data buffer %s; online training goes on without it (its next "
                      "updates differ from those of a run that was not interrupted)",
                      "was written by another number of processes or devices" if "buffer_state" in metadata
                      else "is missing")
    if not bool(self._all_finite(tree["params"])):
      self.restore_good(f"the restored state (version {metadata['version']}) has non-finite params")
      return
    self.params = self.on_group(self.home, tree["params"])
    self.opt_state = sharding.place(tree["opt_state"], self._opt_shardings)
    self.version = int(metadata["version"])
    self.publish()
    self._good = self._snapshot()
    logging.info("drafter: restored version %d, its optimizer and its data buffer of %d samples (%d pairs) of step %d",
                 self.version, len(self.buffer.entries), self.buffer.num_pairs, self.buffer.step)

  def wait_for_checkpoints(self) -> None:
    if self._checkpointer is not None:
      self._checkpointer.wait()


@jax.jit
def _scale(grads, weight):
  return jax.tree.map(lambda x: weight * x, grads)


@jax.jit
def _accumulate(total, grads, weight):
  return jax.tree.map(lambda t, x: t + weight * x, total, grads)
