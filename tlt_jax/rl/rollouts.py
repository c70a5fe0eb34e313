"""The RL loop's rollouts from a config: which kind, on which devices (one place).

`make(config, policy, drafter, tok, devices)` returns the rollout of the RL steps and the one of the
held-out evaluations:
  * with an EAGLE drafter (`rollout.speculative` and an EAGLE strategy): `TLTRollout`, one group
    engine per `rollout.groups` device group, the drafter trained on the idle groups; evaluations
    on their own `PlainRollout` (`make_eval`) over this process's devices, which decodes the fixed
    batch without compaction (one bucket to compile);
  * else (the baseline, or suffix drafts alone with `rollout.drafter='suffix'`): one `PlainRollout`
    over all the devices, its rows split over as many groups of devices as the TLT rollout's (each group
    tensor-parallel as those are: `mesh`), as many rows at once as the TLT groups together; the
    evaluations use it too (compiled for the rollouts anyway).
Per-row keys make the samples the same either way. The engines, sampling, bandits and the TLT and
drafter trainer configs come from `tlt_jax.config`'s builders (each config subtree mirrors its dataclass).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import ml_collections

from tlt_jax import distributed, sharding
from tlt_jax.drafter.buffer import BufferConfig, DataBuffer
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import CausalLM
from tlt_jax.rl import builders
from tlt_jax.rollout.base import BaseRollout
from tlt_jax.rollout.plain import PlainRollout
from tlt_jax.rollout.tlt import TLTRollout
from tlt_jax.rollout.tools import Turns


def uses_drafter(config) -> bool:
  """Whether the rollout speculates with an EAGLE drafter (else suffix arms alone, or no speculation)."""
  return config.rollout.speculative and any(not s.suffix for s in builders.strategies(config))


def check(config) -> None:
  """What the rollouts of a multi-process run need (ValueError naming the key)."""
  if distributed.multiprocess() and not uses_drafter(config):
    raise ValueError("config.rollout.speculative=False or rollout.drafter='suffix': a rollout without an EAGLE "
                     "drafter runs in one process only; several processes run the TLT group engines "
                     "(config.rollout.speculative=True, rollout.drafter='eagle')")


def _stop_ids(tok, turns: Turns | None) -> tuple[int, ...]:
  """The tokens that end a row's turn: the tokenizer's EOS, and with tools the template's end of a turn (none
  without a tokenizer: a dry run's of a policy whose directory is not there)."""
  if tok is None:
    return ()
  return tuple(dict.fromkeys((tok.eos_token_id,) + (() if turns is None else (turns.stop_token_id,))))


def mesh(devices: Sequence[jax.Device], group_size: int) -> jax.sharding.Mesh:
  """A rollout's mesh over `devices`: rows split over groups of `group_size` (a TLT rollout group's), each group
  tensor-parallel as a TLT group's engine is (one device too: its platform picks the attention kernels)."""
  if len(devices) % group_size:
    raise ValueError(f"{len(devices)} devices do not split into rollout groups of {group_size} (config.rollout.groups)")
  return sharding.make_mesh({"data": len(devices) // group_size, "tensor": group_size}, devices)


def group_size(config: ml_collections.ConfigDict, devices: int) -> int:
  """Devices per rollout group: `devices` (every process's) over `rollout.groups`."""
  return max(devices // config.rollout.groups, 1)


def make_eval(config: ml_collections.ConfigDict, policy: CausalLM, tok, rows: int,
              temperature: float = -1.0, turns: Turns | None = None,
              devices: Sequence[jax.Device] | None = None, group: int | None = None) -> PlainRollout:
  """A rollout for evaluations of `rows` rows at once (a set's prompts x samples) on this process's
  `devices` (default: all of them) in rollout groups of `group` devices (default: the run's, `group_size`),
  sampling at `temperature` (-1: the rollout's), without compaction: one bucket to compile; `turns`: the tool
  calls' runner (multi-turn)."""
  sampling = builders.sampling_params(config, _stop_ids(tok, turns))
  if temperature >= 0:
    sampling = dataclasses.replace(sampling, temperature=temperature)
  devices = jax.local_devices() if devices is None else list(devices)
  group = group_size(config, jax.device_count()) if group is None else group
  return PlainRollout(policy, builders.engine_config(config, largest_bucket=1 << max(rows - 1, 0).bit_length(),
                                                       compact=False), sampling, mesh(devices, group), turns=turns)


def make(config: ml_collections.ConfigDict, policy: CausalLM, drafter: Drafter | None, tok,
         devices: Sequence[jax.Device], turns: Turns | None = None) -> tuple[BaseRollout, BaseRollout | None]:
  """(the RL steps' rollout, the held-out evaluations' or None without `eval.every`) (module docstring).

  Args:
    config: the run's config.
    policy: the policy; its current params are the rollouts' until `set_policy_params`.
    drafter: the EAGLE drafter (None: `uses_drafter(config)` must be False).
    tok: the tokenizer (its EOS stops the responses).
    devices: what the rollouts run on (every process's).
    turns: runs the rows' tool calls (`builders.tool_turns`); None: one turn per response.
  """
  check(config)
  c = config
  strategies = builders.strategies(c) if c.rollout.speculative else ()
  sampling = builders.sampling_params(c, _stop_ids(tok, turns))
  make_bandit = lambda: builders.bandit(c, strategies)
  devices = list(devices)
  group = group_size(c, len(devices))
  if not uses_drafter(c):
    largest = c.rollout.engine.batch_buckets[-1] * c.rollout.groups
    rollout = PlainRollout(policy, builders.engine_config(c, strategies, largest_bucket=largest), sampling,
                           mesh(devices, group), bandit=make_bandit() if strategies else None, turns=turns)
    return rollout, rollout if c.eval.every else None
  if drafter is None:
    raise ValueError("config.rollout.speculative=True with EAGLE strategies needs a drafter")
  rollout = TLTRollout(
      policy, drafter, builders.engine_config(c, strategies, capture_hidden=True), sampling, devices,
      c.rollout.groups, DataBuffer(BufferConfig(**c.drafter.buffer)), builders.tlt_config(c),
      builders.drafter_trainer_config(c), make_bandit, turns)
  local = [d for d in devices if d.process_index == jax.process_index()]
  return rollout, make_eval(c, policy, tok, c.eval.size * c.eval.num_samples, turns=turns, devices=local,
                            group=group) if c.eval.every else None
