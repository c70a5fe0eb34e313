"""The TLT rollout: a data-parallel rollout over device groups whose idle groups train the drafter.

The devices are split into G groups; each group runs its own `Engine` (speculative tail, bandit)
on a sub-mesh of its devices, tensor-parallel (the model's heads, MLP and vocabulary split over them,
Megatron-style: a group of 4 holds a quarter of the weights and of the KV cache per device), over a
contiguous shard of the prompts (a host thread per group,
tlt_jax.rollout.groups; `prompt_offset` keeps every sample's RNG keys global, so the samples are
exactly those of one engine). The caller's thread is the scheduler and tracks each group as BUSY (decoding its shard),
IDLE (done, its samples, with the prompt and response features the engine captured, are in the
drafter's buffer) or TRAINING. While any group is BUSY, every round takes all groups that are not
BUSY (a set that only grows) and runs one synchronous update of the ONE master drafter on them
(tlt_jax.drafter.trainer). Rounds stop at the first boundary after the LAST group finishes (the
rollout's end, not the trainer's own work). The updated drafter then goes to every group's engine
with a new version number, for the next rollout; the running tail keeps the drafter it started
with. With one group there is no idle group: the drafter trains `solo_steps` steps in the gap after
the rollout, and metrics say so. NaN/inf: an engine whose drafter's outputs turn non-finite decodes
the rest of its rollout without speculation; then the drafter trainer restores its last finite
state and it is pushed, with a warning and drafter/restored=1.

Several processes (`jax.distributed`, one per host): each group lies on one process's devices and
is run by that process alone (JAX's multi-controller model); every process keeps an identical copy
of the master drafter on its first group's devices and its own buffer of its groups' features.
Rounds are synchronous across processes: each round every process posts, through the coordination
service's key-value store (tlt_jax.distributed.allgather, host only: the devices of busy groups
keep decoding), whether all its groups are done and which of them are idle; when some are, the
idle ones train (the drafter trainer exchanges their gradients): one drafter, checked identical
after every push. After the rollout the processes exchange their groups' samples (without
features), so every process returns all samples. A process whose groups are all busy polls every
`poll_s`; asynchronous per-process rounds would save those round trips but let the copies drift.

Metrics (`generate`'s): drafter/{steps,loss,loss_last,top1,eval_loss,version,version_used,restored},
rollout/{accept_len,tokens,refills,preemptions,resumed_tokens (summed over groups),tokens_per_s (over the
rollout's wall time),sd_share (of the groups' summed time),tail_share,idle_slot_fraction (group means),
peak_rows,peak_pages (the busiest group's)},
spot/{groups,idle_device_s,harvested_device_s,train_rounds,overrun_s,gap_s,checkpoint_s,wall_s}.
The state (`state_dict`) is the drafter trainer's (params, optimizer, data buffer, version, RL
step) and the bandits'. Executables (every group's engine and gradient step, the update, the
evaluation) are compiled before the first rollout starts decoding; no round compiles.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from tlt_jax import distributed, fields, sharding
from tlt_jax.drafter.buffer import DataBuffer
from tlt_jax.drafter.model import Drafter
from tlt_jax.drafter.trainer import DrafterTrainer, DrafterTrainerConfig, Round
from tlt_jax.executables import ExecutablePool
from tlt_jax.models.transformer import CausalLM
from tlt_jax.rollout.bandit import Bandit
from tlt_jax.rollout.base import BaseRollout
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.groups import GroupRun
from tlt_jax.rollout.state import EngineConfig, Sample
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.tools import Turns

@dataclasses.dataclass(frozen=True)
class TLTConfig:
  """The schedule of the rollout groups. Config: `rollout.tlt` (the timeouts keep their defaults in a run)."""

  enabled: bool = True  # False: the same sharded rollout, no drafter training (baselines, ablations)
  solo_steps: int = 8  # with one group: drafter steps in the gap after each rollout
  timeout_s: float = 3600.0  # a rollout group that has not finished by then is an error, not a hang
  poll_s: float = 0.05  # several processes: how often a process with only busy groups joins a round

  def __post_init__(self):
    fields.at_least(self, 0, "solo_steps")


class TLTRollout(BaseRollout):
  """See the module docstring."""

  def __init__(self, policy: CausalLM, drafter: Drafter, engine_config: EngineConfig, sampling: SamplingParams,
               devices: Sequence[jax.Device], groups: int, buffer: DataBuffer, config: TLTConfig = TLTConfig(),
               drafter_config: DrafterTrainerConfig = DrafterTrainerConfig(),
               make_bandit: Callable[[], Bandit] | None = None, turns: Turns | None = None):
    """One engine per device group, each with the policy's params and the drafter, and the drafter trainer.

    Args:
      policy: the policy (its current params are the engines' until `set_policy_params`).
      drafter: the initial drafter (`drafter_trainer` trains it on, `drafter_model()` is the latest).
      engine_config: every group's engine config (capture_hidden: the drafter trains on the features).
      sampling: temperature, top-k/p, the response budget, stop tokens and seed.
      devices: every process's devices, split into `groups` equal groups in order.
      groups: the number of rollout groups.
      buffer: this process's drafter data buffer.
      config: the schedule (training on or off, solo steps, timeouts).
      drafter_config: the drafter trainer's (learning rate, batch shapes, checkpoints).
      make_bandit: a new bandit per group engine (with strategies).
    """
    devices = list(devices)
    if groups < 1 or len(devices) % groups:
      raise ValueError(f"{len(devices)} devices do not split into groups={groups} equal device groups")
    if not engine_config.capture_hidden:
      raise ValueError("the TLT rollout trains the drafter on captured features: engine_config.capture_hidden "
                       "must be True")
    self.config = config
    per = len(devices) // groups
    self.meshes = [sharding.make_mesh({"tensor": per}, devices[g * per:(g + 1) * per]) for g in range(groups)]
    owners = [{d.process_index for d in m.devices.flat} for m in self.meshes]
    for g, owner in enumerate(owners):
      if len(owner) > 1:
        raise ValueError(f"rollout group {g} spans processes {sorted(owner)}: groups={groups} must split every "
                         "process's devices into whole groups")
    self.groups = [g for g in range(groups) if owners[g] == {jax.process_index()}]  # the groups this process runs
    if not self.groups:
      raise ValueError(f"process {jax.process_index()} holds no rollout group: groups={groups} must be at least "
                       f"the process count {jax.process_count()}")
    self.engines = [Engine(policy, engine_config, sampling, mesh=self.meshes[g], drafter=drafter,
                           bandit=make_bandit() if make_bandit else None, turns=turns) for g in self.groups]
    self._engine = dict(zip(self.groups, self.engines))
    self.drafter_trainer = DrafterTrainer(policy, drafter, self.meshes, self.groups, buffer, drafter_config,
                                          publish=self._push)
    self.last: dict = {}  # the latest rollout's schedule: finish times, rounds, end (for tests and logs)
    self.set_policy_params(nnx.state(policy))
    self._push()

  def set_policy_params(self, params: nnx.State) -> None:
    """New policy params into every group's engine: the caller's own arrays on a group whose devices and layout
    they already have (the trainer's update, which donates them, runs after `release_policy_params`), copies
    on the others."""
    if distributed.multiprocess():  # e.g. the trainer's arrays over every process's devices
      params = distributed.to_host(params)
    for g, engine in zip(self.groups, self.engines):
      engine.set_params(self.drafter_trainer.on_group(g, params, alias=True))

  def _push(self) -> None:
    """The master drafter into every group's engine (copies), with its version."""
    trainer = self.drafter_trainer
    distributed.check_identical(trainer.params, "the master drafter")
    for g, engine in zip(self.groups, self.engines):
      engine.set_drafter_params(trainer.on_group(g, trainer.params))
    self.engine_versions = [trainer.version] * len(self.engines)

  def _policy_params(self) -> dict[int, nnx.State]:
    return {g: engine.params for g, engine in zip(self.groups, self.engines)}

  def drafter_model(self) -> Drafter:
    return self.drafter_trainer.model()

  def _bounds(self, num_prompts: int) -> np.ndarray:
    """Group g's prompts: bounds[g] .. bounds[g + 1] - 1."""
    return np.linspace(0, num_prompts, len(self.meshes) + 1).astype(int)

  def prepare(self, num_prompts: int, num_samples: int, first_group_only: bool = False) -> None:
    bounds = self._bounds(num_prompts)
    def prepare(g, engine):  # refill or waves included
      engine.prepare((bounds[g + 1] - bounds[g]) * num_samples)
    engines = self.engines[:1] if first_group_only else self.engines
    # Each group compiles its own executables (they are bound to its devices): in parallel, since
    # XLA compiles one module per thread.
    with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
      list(pool.map(prepare, self.groups, engines))
    self.drafter_trainer.compile(self._policy_params())

  def pools(self) -> dict[str, ExecutablePool]:
    return {**super().pools(), "drafter": self.drafter_trainer.pool}

  # ---- one RL step ----

  def _generate(self, prompts: Sequence[Sequence[int]], num_samples: int, max_total_len, prompt_offset: int,
                history, on_progress) -> tuple[list[Sample], dict[str, float]]:
    """`BaseRollout.generate` on the group engines while idle groups train the drafter (module
    docstring); the metrics are the module docstring's."""
    G = len(self.meshes)
    if len(prompts) < G:
      raise ValueError(f"{len(prompts)} prompts cannot be sharded over groups={G} device groups")
    for i, p in enumerate(prompts):  # checked here: the engines compile before they would check
      if not 0 < len(p) <= self.engines[0].config.max_prompt_len:
        raise ValueError(f"prompt {i} has {len(p)} tokens; need 1..{self.engines[0].config.max_prompt_len} "
                         "(max_prompt_len)")
    trainer = self.drafter_trainer
    rl_step = trainer.next_step()
    bounds = self._bounds(len(prompts))
    limit = lambda a, b: list(max_total_len[a:b]) if isinstance(max_total_len, Sequence) else max_total_len
    self.prepare(len(prompts), num_samples)
    version_used = min(self.engine_versions)

    def work(g):
      a, b = bounds[g], bounds[g + 1]
      out = self._engine[g].generate(prompts[a:b], num_samples, limit(a, b), prompt_offset=int(prompt_offset + a),
                                     history=None if history is None else history[a:b], on_progress=on_progress)
      local = [dataclasses.replace(s, prompt_index=s.prompt_index - prompt_offset) for s in out.samples]
      return dataclasses.replace(out, samples=local)

    multi = distributed.multiprocess()
    run = GroupRun(self.groups, work, lambda g, out: trainer.buffer.add(rl_step, out.samples, prompts),
                   self.config.timeout_s, self.config.poll_s if multi else None)
    trains = lambda: trainer.trainable() and self.config.enabled
    rounds: list[Round] = []
    while True:
      done, idle = run.wait(trains)
      if multi:  # one round for all processes: done when all are, trained by every idle group
        views = distributed.allgather((done, idle), timeout_s=run.left_s() + distributed.TIMEOUT_S)
        done, idle = all(d for d, _ in views), tuple(sorted(g for _, groups in views for g in groups))
      if done:
        break
      if idle:
        batches = run.claim(idle, lambda g: trainer.batch(g, len(rounds)))
        rounds.append(trainer.round(idle, batches, self._policy_params()))
    start, results, finished = run.start, [None] * G, [0.0] * G
    for g, out in run.join().items():
      results[g], finished[g] = out, run.finished[g]
    if multi:  # every process returns every group's samples (features stay where they were captured)
      strip = lambda s: dataclasses.replace(s, hidden=None, prompt_hidden=None)
      mine = {g: (dataclasses.replace(results[g], samples=[strip(s) for s in results[g].samples]), finished[g] - start)
              for g in self.groups}
      for part in distributed.allgather(mine):
        for g, (result, after) in part.items():
          if g not in run.state:
            results[g], finished[g] = result, start + after
    end = max(finished)
    stop = time.perf_counter()
    gap_s = 0.0
    if G == 1 and self.config.enabled and trainer.trainable():
      for _ in range(self.config.solo_steps):
        rounds.append(trainer.round((0,), {0: trainer.batch(0, len(rounds))}, self._policy_params()))
      gap_s = time.perf_counter() - stop
    faults = [g for g, r in enumerate(results) if r.metrics.drafter_nonfinite]
    restored, checkpoint_s = trainer.end_step(
        bool(rounds), f"non-finite outputs in the rollouts of groups {faults}" if faults else None)
    self.last = {"start": start, "finished": finished, "end": end, "rounds": rounds, "checkpoint_s": checkpoint_s,
                 "restored": restored}
    samples = sorted((s for r in results for s in r.samples), key=lambda s: (s.prompt_index, s.sample_index))
    return samples, self._metrics(results, rounds, finished, start, end, stop, gap_s, version_used)

  def _metrics(self, results, rounds: list[Round], finished, start, end, stop, gap_s, version_used) -> dict[str, float]:
    sizes = [m.size for m in self.meshes]
    G = len(sizes)
    overlap = lambda r, g: max(0.0, min(r.end, end) - max(r.start, finished[g]))
    passes = sum(r.metrics.verify_passes for r in results)
    spec_tokens = sum(s.tokens for r in results for s in r.metrics.segments if s.strategy)
    rollout_s = max(sum(r.metrics.wall_s for r in results), 1e-9)  # the groups' summed rollout time
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
        "drafter/version": float(self.drafter_trainer.version),
        "drafter/version_used": float(version_used),
        "drafter/restored": float(self.last["restored"]),
        "rollout/accept_len": spec_tokens / max(passes, 1),
        "rollout/tokens": float(sum(r.metrics.tokens for r in results)),
        # The rollout's tokens over its wall time (until the last group finished); time in speculative
        # (exploring) plays over the groups' summed rollout time.
        "rollout/tokens_per_s": sum(r.metrics.tokens for r in results) / max(end - start, 1e-9),
        "rollout/sd_share": sum(r.metrics.sd_s for r in results) / rollout_s,
        "rollout/probe_share": sum(r.metrics.probe_s for r in results) / rollout_s,
        "rollout/refills": float(sum(r.metrics.refills for r in results)),
        "rollout/preemptions": float(sum(r.metrics.preemptions for r in results)),
        "rollout/resumed_tokens": float(sum(r.metrics.resumed_tokens for r in results)),
        "rollout/peak_rows": float(max(r.metrics.peak_rows for r in results)),
        "rollout/peak_pages": float(max(r.metrics.peak_pages for r in results)),
        "rollout/tail_share": float(np.mean([r.metrics.tail_share for r in results])),
        "rollout/idle_slot_fraction": float(np.mean([r.metrics.idle_slot_fraction for r in results])),
        # Summed over the groups: the time split and the tool turns.
        **{f"rollout/{k}": float(sum(getattr(r.metrics, k) for r in results))
           for k in ("prefill_s", "decode_s", "tool_append_s", "tool_wait_s", "tool_calls", "tool_turns",
                     "tool_tokens")},
    }
    if rounds:
      n = sum(r.metrics["pairs"] for r in rounds)
      out["drafter/loss"] = sum(r.metrics["loss"] * r.metrics["pairs"] for r in rounds) / max(n, 1.0)
      out["drafter/loss_last"] = rounds[-1].metrics["loss"]
    out.update(self.drafter_trainer.evaluate(self.engines[0].params))  # several processes: this process's samples
    return out

  # ---- checkpoints ----

  def state_dict(self) -> tuple[dict, dict]:
    """The bandits' and the drafter trainer's state (under "drafter")."""
    arrays, meta = super().state_dict()
    arrays["drafter"], meta["drafter"] = self.drafter_trainer.state_dict()
    return arrays, meta

  def abstract_state(self, metadata: dict) -> dict:
    return {**super().abstract_state(metadata),
            "drafter": self.drafter_trainer.abstract_state(metadata.get("drafter") or {})}

  def load_state_dict(self, arrays: dict, metadata: dict) -> None:
    self.drafter_trainer.load_state_dict(arrays["drafter"], metadata["drafter"])
    super().load_state_dict(arrays, metadata)

  def close(self) -> None:
    self.drafter_trainer.wait_for_checkpoints()
