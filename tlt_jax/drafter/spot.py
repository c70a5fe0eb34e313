"""Spot trainer: a data-parallel rollout over device groups that trains the drafter on the idle ones.

The devices are split into G groups; each group runs its own `Engine` on a sub-mesh of its
devices over a contiguous shard of the prompts (host threads drive the groups; `prompt_offset`
keeps every sample's RNG keys global, so the samples are exactly those of one engine). The
caller's thread is the scheduler and tracks each group as BUSY (decoding its shard), IDLE (done,
its samples, with the prompt and response features the engine captured, are in the buffer)
or TRAINING. While any group is BUSY, every round takes all
groups that are not BUSY (a set that only grows), computes one gradient per group on its own
devices from its own buffer batch, averages them weighted by pairs and applies ONE optimizer
update to the single master drafter: synchronous data parallelism over the idle groups, so
there is one drafter, never per-worker replicas that drift apart. Rounds stop at the first
boundary after the LAST group finishes (the rollout's end, not the trainer's own work). The
updated drafter then goes to every group's engine with a new version number, for the next
rollout; the running tail keeps the drafter it started with. With one group there is no idle
group: the trainer runs `solo_steps` steps in the gap after the rollout and says so in metrics.
NaN/inf: an engine whose drafter's outputs turn non-finite decodes the rest of its rollout
without speculation; then (or when training made the params non-finite, or a checkpoint brings
non-finite ones) the last finite drafter state is restored and pushed, with a warning and
drafter/restored=1.

Several processes (`jax.distributed`, one per host): each group lies on one process's devices and
is run by that process alone (JAX's multi-controller model); every process keeps an identical copy
of the master drafter on its first group's devices and its own buffer of its groups' features.
Rounds are synchronous across processes: each round every process posts, through the coordination
service's key-value store (tlt_jax.distributed.allgather, host only: the devices of busy groups
keep decoding), whether all its groups are done and which of them are idle; when some are, the
idle ones compute gradients on their devices, the processes exchange them (host copies) and each
applies the same pair-weighted mean, in group order, to its copy: one drafter, checked identical
after every push. After the rollout the processes exchange their groups' samples (without
features), so every process returns all samples. A process whose groups are all busy polls every
`poll_s`; asynchronous per-process rounds would save those round trips but let the copies drift.

API (one call per RL step):
  trainer = SpotTrainer(policy, drafter, engine_config, sampling, devices, groups, buffer, SpotConfig())
  samples, metrics = trainer.rollout(prompts, num_samples, max_total_len)
  trainer.set_policy_params(nnx.state(policy))          # after each actor update
  tree, meta = trainer.state_dict()                      # RL checkpoints (every process calls it)
  trainer.load_state_dict(restored_tree, meta)           # restored like trainer.abstract_state(meta)
`samples` are engine `Sample`s in (prompt_index, sample_index) order; `metrics` is a flat dict
of floats: drafter/{steps,loss,top1,eval_loss,version,version_used},
rollout/{accept_len,tokens,refills (summed over groups),tail_share,idle_slot_fraction (group means)},
spot/{groups,idle_device_s,harvested_device_s,train_rounds,overrun_s,gap_s,checkpoint_s,wall_s},
drafter/restored.
`tree` (orbax-saveable) holds the drafter params and optimizer state and each process's data buffer
(`tlt_jax.checkpoint.stack_processes`); `meta` is JSON-able (version, RL step, the buffers' step and
count of samples, their arrays' shapes). That is all the drafter's next updates depend on: the
batches' random draws derive from (seed, RL step, round, group), not from a generator carried
along, so a resumed run trains the drafter as an uninterrupted one would (given the same rounds:
with one group a fixed number per step; with several, as many as fit while the tail decodes).
Executables (every group's engine and gradient step, the update, the evaluation) are compiled
before the first rollout starts decoding; no round compiles.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tlt_jax import checkpoint as rl_checkpoint
from tlt_jax import distributed, fields, sharding
from tlt_jax.drafter import checkpoint, train
from tlt_jax.drafter.buffer import DataBuffer
from tlt_jax.drafter.model import Drafter
from tlt_jax.models.transformer import CausalLM
from tlt_jax.rollout.bandit import Bandit
from tlt_jax.rollout.engine import Engine, EngineConfig, Sample
from tlt_jax.rollout.sampling import SamplingParams

BUSY, IDLE, TRAINING = "busy", "idle", "training"


@dataclasses.dataclass(frozen=True)
class SpotConfig:
  """Online drafter training on idle rollout groups. Config: `drafter.spot` (seed: `seed`; the fields
  after `solo_steps` keep their defaults in a run)."""

  enabled: bool = True  # False: the same sharded rollout, no drafter training (baselines, ablations)
  learning_rate: float = 1e-3
  warmup_steps: int = 20  # linear warmup: a fresh Adam's first steps would jolt a pre-trained drafter
  rows_per_device: int = 2  # packed rows per device in a gradient step
  row_len: int = 128  # pairs per packed row
  solo_steps: int = 8  # with one group: drafter steps in the gap after each rollout
  eval_rows: int = 8  # packed rows of held-out samples for drafter/top1
  seed: int = 0
  checkpoint_dir: str | None = None  # async selective checkpoints (params + optimizer) after each push
  timeout_s: float = 3600.0  # a rollout group that has not finished by then is an error, not a hang
  poll_s: float = 0.05  # several processes: how often a process with only busy groups joins a round

  def __post_init__(self):
    fields.at_least(self, 1, "rows_per_device", "eval_rows")
    fields.at_least(self, 2, "row_len")
    fields.at_least(self, 0, "learning_rate", "solo_steps", "warmup_steps")


@dataclasses.dataclass
class Round:
  """One synchronous drafter update over the groups in `groups`."""

  start: float
  end: float
  groups: tuple[int, ...]
  metrics: dict[str, float]


class SpotTrainer:
  """See the module docstring."""

  def __init__(self, policy: CausalLM, drafter: Drafter, engine_config: EngineConfig, sampling: SamplingParams,
               devices: Sequence[jax.Device], groups: int, buffer: DataBuffer, config: SpotConfig = SpotConfig(),
               make_bandit: Callable[[], Bandit] | None = None):
    devices = list(devices)
    if groups < 1 or len(devices) % groups:
      raise ValueError(f"{len(devices)} devices do not split into groups={groups} equal device groups")
    if not engine_config.capture_hidden:
      raise ValueError("the spot trainer trains on captured features: engine_config.capture_hidden must be True")
    if drafter.feature_layers:
      raise ValueError(f"online training of EAGLE-3 drafters (feature_layers={drafter.feature_layers}) is not "
                       "supported: the engine captures only the last hidden state")
    self.config, self.buffer = config, buffer
    per = len(devices) // groups
    self.meshes = [sharding.make_mesh({"data": per}, devices[g * per:(g + 1) * per]) for g in range(groups)]
    owners = [{d.process_index for d in m.devices.flat} for m in self.meshes]
    for g, owner in enumerate(owners):
      if len(owner) > 1:
        raise ValueError(f"rollout group {g} spans processes {sorted(owner)}: groups={groups} must split every "
                         "process's devices into whole groups")
    self.groups = [g for g in range(groups) if owners[g] == {jax.process_index()}]  # the groups this process runs
    if not self.groups:
      raise ValueError(f"process {jax.process_index()} holds no rollout group: groups={groups} must be at least "
                       f"the process count {jax.process_count()}")
    if config.checkpoint_dir and distributed.multiprocess():
      raise ValueError("spot config checkpoint_dir (selective drafter checkpoints) is single-process only")
    self.home = self.groups[0]  # the master drafter lives on this group's devices
    self.engines = [Engine(policy, engine_config, sampling, mesh=self.meshes[g], drafter=drafter,
                           bandit=make_bandit() if make_bandit else None) for g in self.groups]
    self._engine = dict(zip(self.groups, self.engines))
    warmup = optax.linear_schedule(0.0, config.learning_rate, max(config.warmup_steps, 1))
    self.optimizer = train.make_optimizer(warmup)
    self._grad = train.make_grad_step(drafter, policy)
    self._eval = train.make_eval_step(drafter, policy)
    self._apply = jax.jit(lambda p, s, g: train.apply_gradients(self.optimizer, p, s, g), donate_argnums=(0, 1))
    self._all_finite = jax.jit(
        lambda tree: jnp.all(jnp.asarray([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)])))
    self._hidden = (policy.config.hidden_size, policy.model.embed_tokens.embedding.dtype)
    self.params = self._on_group(self.home, nnx.state(drafter))
    self._home = sharding.param_shardings(self.params, self.meshes[self.home])
    self.opt_state = jax.device_put(self.optimizer.init(self.params), self._replicated(self.home))
    self.last: dict = {}  # the latest rollout's schedule: finish times, rounds, end (for tests and logs)
    self.version = 0
    self.rl_step = -1
    self._compiled: dict | None = None
    self._checkpointer = checkpoint.AsyncDrafterCheckpointer(config.checkpoint_dir) if config.checkpoint_dir else None
    self.set_policy_params(nnx.state(policy))
    self._push()
    self._good = self._snapshot() if self._finite() else None  # (params, opt_state, version) last known finite

  # ---- placement ----

  def _replicated(self, g: int) -> NamedSharding:
    return NamedSharding(self.meshes[g], P())

  def _on_group(self, g: int, state: nnx.State) -> nnx.State:
    """A copy of `state` on group g (never an alias: the update step donates the master params)."""
    return jax.device_put(state, sharding.param_shardings(state, self.meshes[g]), may_alias=False)

  def _rows(self, g: int) -> int:
    return self.config.rows_per_device * self.meshes[g].size

  def _batch_sharding(self, g: int, pairs: train.Pairs):
    return jax.tree.map(lambda x: sharding.array_sharding(x.shape, ("batch",) + (None,) * (x.ndim - 1),
                                                          self.meshes[g]), pairs)

  def set_policy_params(self, state: nnx.State) -> None:
    """New policy weights (after an actor update) into every group's engine and gradient step."""
    if distributed.multiprocess():  # e.g. the trainer's arrays over every process's devices
      state = distributed.to_host(state)
    for g, engine in zip(self.groups, self.engines):  # copies: the caller may donate its params to the next update
      engine.set_params(self._on_group(g, state))

  def _finite(self) -> bool:
    return bool(self._all_finite(self.params))

  def _snapshot(self) -> tuple:
    return (self._on_group(self.home, self.params),
            jax.device_put(self.opt_state, self._replicated(self.home), may_alias=False),
            self.version)

  def _restore_good(self, why: str) -> None:
    """Back to the last finite drafter state (copies of it) on every engine."""
    if self._good is None:
      logging.warning("drafter: %s, and there is no finite drafter state to restore", why)
      return
    params, opt_state, self.version = self._good
    self.params = self._on_group(self.home, params)
    self.opt_state = jax.device_put(opt_state, self._replicated(self.home), may_alias=False)
    self._push()
    logging.warning("drafter: %s; restored its last finite state (version %d)", why, self.version)

  def _push(self) -> None:
    distributed.check_identical(self.params, "the spot trainer's master drafter")
    for g, engine in zip(self.groups, self.engines):
      engine.set_drafter_params(self._on_group(g, self.params))
    self.engine_versions = [self.version] * len(self.engines)

  # ---- compiled once ----

  def _abstract_pairs(self, rows: int) -> train.Pairs:
    h, dtype = self._hidden
    i32, f32 = np.int32, np.float32
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
    t = self.config.row_len
    return train.Pairs(tokens=s((rows, t), i32), positions=s((rows, t), i32), segments=s((rows, t), i32),
                       weights=s((rows, t), f32), hidden=s((rows, t, h), dtype), aux=(),
                       next_hidden=s((rows, t, h), dtype))

  def _compile(self) -> dict:
    if self._compiled is None:
      shaped = lambda tree, shardings: jax.tree.map(
          lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings)
      like = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
      grads = {}
      for g, engine in zip(self.groups, self.engines):
        pairs = self._abstract_pairs(self._rows(g))
        grads[g] = self._grad.lower(like(self._on_group(g, self.params)), like(engine.params),
                                    shaped(pairs, self._batch_sharding(g, pairs))).compile()
      apply = self._apply.lower(like(self.params), like(self.opt_state), like(self.params)).compile()
      pairs = self._abstract_pairs(self.config.eval_rows)
      evaluate = self._eval.lower(like(self.params), like(self.engines[0].params),
                                  shaped(pairs, self._batch_sharding(self.home, pairs))).compile()
      self._compiled = {"grad": grads, "apply": apply, "eval": evaluate}
    return self._compiled

  # ---- one RL step ----

  def rollout(self, prompts: Sequence[Sequence[int]], num_samples: int = 1,
              max_total_len: Sequence[int] | int | None = None,
              prompt_offset: int = 0) -> tuple[list[Sample], dict[str, float]]:
    """Samples every prompt on the group engines while idle groups train the drafter (module docstring).

    `prompt_offset` shifts the prompts' global indices (RNG keys; an RL loop passes the number of
    prompts sampled so far); the returned samples' `prompt_index` counts from 0 within `prompts`.
    """
    G = len(self.meshes)
    if len(prompts) < G:
      raise ValueError(f"{len(prompts)} prompts cannot be sharded over groups={G} device groups")
    for i, p in enumerate(prompts):  # checked here: the engines compile before they would check
      if not 0 < len(p) <= self.engines[0].config.max_prompt_len:
        raise ValueError(f"prompt {i} has {len(p)} tokens; need 1..{self.engines[0].config.max_prompt_len} "
                         "(max_prompt_len)")
    self.rl_step += 1
    bounds = np.linspace(0, len(prompts), G + 1).astype(int)
    limit = lambda a, b: list(max_total_len[a:b]) if isinstance(max_total_len, Sequence) else max_total_len
    def prepare(g, engine):
      a, b = bounds[g], bounds[g + 1]
      engine.prepare((b - a) * num_samples, [len(p) for p in prompts[a:b]])  # refill or waves included
    # Each group compiles its own executables (they are bound to its devices): in parallel, since
    # XLA compiles one module per thread.
    with concurrent.futures.ThreadPoolExecutor(len(self.engines)) as pool:
      list(pool.map(prepare, self.groups, self.engines))
    compiled = self._compile()
    version_used = min(self.engine_versions)

    state, results, errors, finished = {g: BUSY for g in self.groups}, [None] * G, [None] * G, [0.0] * G
    cond = threading.Condition()

    def work(g):
      a, b = bounds[g], bounds[g + 1]
      try:
        out = self._engine[g].generate(prompts[a:b], num_samples, limit(a, b), prompt_offset=int(prompt_offset + a))
        local = [dataclasses.replace(s, prompt_index=s.prompt_index - prompt_offset) for s in out.samples]
        results[g] = dataclasses.replace(out, samples=local)
        with cond:
          self.buffer.add(self.rl_step, results[g].samples, prompts)
      except BaseException as e:  # re-raised by the scheduler
        errors[g] = e
      with cond:
        finished[g] = time.perf_counter()
        state[g] = IDLE
        cond.notify_all()

    start = time.perf_counter()
    threads = [threading.Thread(target=work, args=(g,), name=f"rollout-group-{g}", daemon=True) for g in self.groups]
    for t in threads:
      t.start()
    rounds: list[Round] = []
    deadline = start + self.config.timeout_s
    multi = distributed.multiprocess()
    while True:
      with cond:
        busy = lambda: [g for g in self.groups if state[g] == BUSY]
        ready = lambda: not busy() or (len(busy()) < len(self.groups) and self._trainable() and self.config.enabled)
        left = max(deadline - time.perf_counter(), 0.0)
        if (not cond.wait_for(ready, timeout=min(left, self.config.poll_s) if multi else left) and not multi) or (
            busy() and time.perf_counter() > deadline):
          raise TimeoutError(f"rollout groups {busy()} did not finish within timeout_s={self.config.timeout_s}")
        done = not busy()
        trains = self._trainable() and self.config.enabled
        idle = tuple(g for g in self.groups if state[g] != BUSY) if trains else ()
      if multi:  # one round for all processes: done when all are, trained by every idle group
        views = distributed.allgather((done, idle), timeout_s=left + distributed.TIMEOUT_S)
        done, idle = all(d for d, _ in views), tuple(sorted(g for _, groups in views for g in groups))
      if done:
        break
      if not idle:
        continue
      with cond:
        for g in idle:
          if g in state:
            state[g] = TRAINING
        batches = {g: self._batch(g, len(rounds)) for g in idle if g in state}
      rounds.append(self._round(compiled, idle, batches))
    for t in threads:
      t.join()
    for e in errors:
      if e is not None:
        raise e
    if multi:  # every process returns every group's samples (features stay where they were captured)
      strip = lambda s: dataclasses.replace(s, hidden=None, prompt_hidden=None)
      mine = {g: (dataclasses.replace(results[g], samples=[strip(s) for s in results[g].samples]), finished[g] - start)
              for g in self.groups}
      for part in distributed.allgather(mine):
        for g, (result, after) in part.items():
          if g not in state:
            results[g], finished[g] = result, start + after
    end = max(finished)
    stop = time.perf_counter()
    gap_s = 0.0
    if G == 1 and self.config.enabled and self._trainable():
      for _ in range(self.config.solo_steps):
        rounds.append(self._round(compiled, (0,), {0: self._batch(0, len(rounds))}))
      gap_s = time.perf_counter() - stop
    checkpoint_s = 0.0
    faults = [g for g, r in enumerate(results) if r.metrics.drafter_nonfinite]
    restored = bool(faults) or (bool(rounds) and not self._finite())
    if restored:
      self._restore_good(f"non-finite outputs in the rollouts of groups {faults}" if faults else
                         "training made its params non-finite")
    elif rounds:
      self.version += 1
      self._push()
      self._good = self._snapshot()
      if self._checkpointer is not None:
        t0 = time.perf_counter()
        self._checkpointer.save(self.version, self.params, self.opt_state, self.metadata())
        checkpoint_s = time.perf_counter() - t0  # what the step waits for; the write goes on in the background
    self.last = {"finished": finished, "end": end, "rounds": rounds, "checkpoint_s": checkpoint_s,
                 "restored": restored}
    samples = sorted((s for r in results for s in r.samples), key=lambda s: (s.prompt_index, s.sample_index))
    return samples, self._metrics(results, rounds, finished, start, end, stop, gap_s, version_used)

  def _trainable(self) -> bool:
    return bool(self.buffer.training_entries())

  def _batch(self, g: int, round_index: int) -> train.Pairs:
    """Group g's batch of this step's round `round_index`. Its draws come from a generator of
    (seed, RL step, round, group), not one carried across steps: nothing to checkpoint, and the
    processes of a multi-process run draw independently."""
    rng = np.random.default_rng([self.config.seed, self.rl_step, round_index, g])
    return self.buffer.batch(rng, self._rows(g), self.config.row_len)

  def _round(self, compiled, groups: tuple[int, ...], batches: dict[int, train.Pairs]) -> Round:
    """One synchronous update: a gradient per group on its devices, pair-weighted mean, one apply.

    `batches` holds this process's groups among `groups`; the others' gradients come from their
    processes (host copies), and every process sums them in the same order."""
    t0 = time.perf_counter()
    local = {}
    for g, batch in batches.items():  # dispatched without waiting: the groups compute in parallel
      params = jax.device_put(self.params, sharding.param_shardings(self.params, self.meshes[g]))
      local[g] = compiled["grad"][g](params, self._engine[g].params,
                                     jax.device_put(batch, self._batch_sharding(g, batch)))
    if distributed.multiprocess():  # leaves only (host copies); every process compiled the same output tree
      tree = compiled["grad"][self.home].out_tree
      for part in distributed.allgather({g: jax.device_get(jax.tree.leaves(out)) for g, out in local.items()}):
        for g, leaves in part.items():
          local.setdefault(g, jax.tree.unflatten(tree, leaves))
    outs = [local[g] for g in groups]
    weights = np.asarray([float(m["pairs"]) for _, m in outs])
    total = max(weights.sum(), 1.0)
    grads = jax.tree.map(lambda *gs: sum(w / total * x for w, x in zip(weights, gs)),
                         *[jax.device_put(g, self._home) for g, _ in outs])
    self.params, self.opt_state = compiled["apply"](self.params, self.opt_state, grads)
    metrics = {k: float(np.dot(weights, [float(m[k]) for _, m in outs]) / total) for k in ("loss", "top1")}
    jax.block_until_ready(self.params)
    return Round(t0, time.perf_counter(), groups, {**metrics, "pairs": float(weights.sum())})

  def _metrics(self, results, rounds: list[Round], finished, start, end, stop, gap_s, version_used) -> dict[str, float]:
    sizes = [m.size for m in self.meshes]
    G = len(sizes)
    overlap = lambda r, g: max(0.0, min(r.end, end) - max(r.start, finished[g]))
    passes = sum(r.metrics.verify_passes for r in results)
    spec_tokens = sum(s.tokens for r in results for s in r.metrics.segments if s.strategy)
    out = {
        "spot/groups": float(G),
        "spot/wall_s": stop - start,
        "spot/idle_device_s": sum((end - finished[g]) * sizes[g] for g in range(G)),
        "spot/harvested_device_s": sum(overlap(r, g) * sizes[g] for r in rounds for g in r.groups),
        "spot/train_rounds": float(sum(r.start < end for r in rounds)),
        "spot/overrun_s": max([r.end - end for r in rounds if r.start < end] + [0.0]),
        "spot/gap_s": gap_s,  # one group: training time added after the rollout
        "spot/checkpoint_s": self.last["checkpoint_s"],
        "drafter/steps": float(len(rounds)),
        "drafter/version": float(self.version),
        "drafter/version_used": float(version_used),
        "drafter/restored": float(self.last["restored"]),
        "rollout/accept_len": spec_tokens / max(passes, 1),
        "rollout/tokens": float(sum(r.metrics.tokens for r in results)),
        "rollout/refills": float(sum(r.metrics.refills for r in results)),
        "rollout/tail_share": float(np.mean([r.metrics.tail_share for r in results])),
        "rollout/idle_slot_fraction": float(np.mean([r.metrics.idle_slot_fraction for r in results])),
    }
    if rounds:
      n = sum(r.metrics["pairs"] for r in rounds)
      out["drafter/loss"] = sum(r.metrics["loss"] * r.metrics["pairs"] for r in rounds) / max(n, 1.0)
      out["drafter/loss_last"] = rounds[-1].metrics["loss"]
    held = self.buffer.eval_batch(self.config.eval_rows, self.config.row_len)
    if held is not None:  # several processes: this process's held-out samples
      held = jax.device_put(held, self._batch_sharding(self.home, held))
      m = self._compiled["eval"](self.params, self.engines[0].params, held)
      out["drafter/eval_loss"], out["drafter/top1"] = float(m["loss"]), float(m["top1"])
    return out

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
    """Restores what `state_dict` returned and pushes the drafter to every engine."""
    for key in ("params", "opt_state"):
      if key not in tree:
        raise KeyError(f"spot trainer state has no {key!r}")
    for key in ("version", "rl_step"):
      if key not in metadata:
        raise KeyError(f"spot trainer metadata has no {key!r}")
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
      self._restore_good(f"the restored state (version {metadata['version']}) has non-finite params")
      return
    self.params = self._on_group(self.home, tree["params"])
    self.opt_state = jax.device_put(tree["opt_state"], self._replicated(self.home), may_alias=False)
    self.version = int(metadata["version"])
    self._push()
    self._good = self._snapshot()
    logging.info("drafter: restored version %d, its optimizer and its data buffer of %d samples (%d pairs) of step %d",
                 self.version, len(self.buffer.entries), self.buffer.num_pairs, self.buffer.step)

  def wait_for_checkpoints(self) -> None:
    if self._checkpointer is not None:
      self._checkpointer.wait()
