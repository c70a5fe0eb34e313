"""One engine, data-parallel over a mesh: the RL loop's baseline rollout (its tail speculates with
suffix drafts alone when the engine has suffix strategies) and its held-out evaluations."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
from flax import nnx

from tlt_jax import sharding
from tlt_jax.models.transformer import CausalLM
from tlt_jax.rollout.bandit import Bandit
from tlt_jax.rollout.base import BaseRollout
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.state import EngineConfig, Sample
from tlt_jax.rollout.tools import Turns
from tlt_jax.rollout.sampling import SamplingParams


class PlainRollout(BaseRollout):
  """One `Engine` over `mesh` (module docstring)."""

  def __init__(self, policy: CausalLM, engine_config: EngineConfig, sampling: SamplingParams,
               mesh: jax.sharding.Mesh | None = None, bandit: Bandit | None = None, turns: Turns | None = None):
    """One engine over `mesh` with the policy's current params.

    Args:
      policy: the policy (its current params are the engine's until `set_policy_params`).
      engine_config: the engine's batch buckets, lengths and strategies.
      sampling: temperature, top-k/p, the response budget, stop tokens and seed.
      mesh: rows split over its data axis, the model over its tensor axis (`rl.rollouts.mesh`); None: one device.
      bandit: picks the engine's strategy per batch (with strategies).
      turns: runs the rows' tool calls (multi-turn rollouts, `tlt_jax.rollout.tools`); None: single turns.
    """
    self.engine = Engine(policy, engine_config, sampling, mesh=mesh, bandit=bandit, turns=turns)
    self.engines, self.groups = [self.engine], [0]
    self._shardings = None if mesh is None else sharding.param_shardings(nnx.state(policy), mesh)
    self.set_policy_params(nnx.state(policy))  # laid out over the mesh

  def prepare(self, num_prompts: int, num_samples: int, first_group_only: bool = False) -> None:
    self.engine.prepare(num_prompts * num_samples)

  def _generate(self, prompts: Sequence[Sequence[int]], num_samples: int, max_total_len, prompt_offset: int,
                history, on_progress) -> tuple[list[Sample], dict[str, float]]:
    """See `BaseRollout.generate`; the metrics are the engine's `RolloutMetrics.summary()`."""
    self.prepare(len(prompts), num_samples)
    out = self.engine.generate(prompts, num_samples, max_total_len, prompt_offset=prompt_offset, history=history,
                               on_progress=on_progress)
    samples = [dataclasses.replace(s, prompt_index=s.prompt_index - prompt_offset) for s in out.samples]
    return samples, out.metrics.summary()

  def set_policy_params(self, params: nnx.State) -> None:
    """The policy's params laid out on the engine's mesh; the caller's own arrays where they already are (no
    second copy of the policy: the trainer's update, which donates its params, runs after
    `release_policy_params`)."""
    self.engine.set_params(params if self._shardings is None else sharding.place(params, self._shardings, alias=True))
