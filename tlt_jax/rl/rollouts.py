"""The RL loop's rollouts from a config: which kind, on which devices (one place).

`make(config, policy, drafter, tok, devices)` returns the rollout of the RL steps and the one of the
held-out evaluations:
  * with an EAGLE drafter (`rollout.speculative` and an EAGLE strategy): `TLTRollout`, one group
    engine per `rollout.groups` device group, the drafter trained on the idle groups; evaluations
    on their own `PlainRollout` over all the devices, which decodes the fixed batch without
    compaction (one bucket to compile);
  * else (the baseline, or suffix drafts alone with `rollout.drafter='suffix'`): one `PlainRollout`
    data-parallel over all the devices, as many rows at once as the TLT groups together; the
    evaluations use it too (compiled for the rollouts anyway).
Per-row keys make the samples the same either way.
"""

from __future__ import annotations

from typing import Sequence

import jax
import ml_collections

from tlt_jax import config as config_lib
from tlt_jax import distributed, sharding
from tlt_jax.drafter.buffer import BufferConfig, DataBuffer
from tlt_jax.drafter.model import Drafter
from tlt_jax.drafter.trainer import DrafterTrainerConfig
from tlt_jax.models import CausalLM
from tlt_jax.rollout.bandit import Bandit
from tlt_jax.rollout.base import BaseRollout
from tlt_jax.rollout.state import EngineConfig
from tlt_jax.rollout.plain import PlainRollout
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.tlt import TLTConfig, TLTRollout


def engine_config(config, strategies=(), largest_bucket: int | None = None, compact: bool = True,
                  capture_hidden: bool = False) -> EngineConfig:
  """The rollout engines' config; `largest_bucket` (default rollout.batch_buckets) sets the buckets."""
  r = config.rollout
  buckets = tuple(2**i for i in range((largest_bucket or r.batch_buckets).bit_length()))
  return EngineConfig(batch_buckets=buckets, max_prompt_len=config.data.max_prompt_len, max_new_tokens=r.max_new_tokens,
                      segment_steps=r.segment_steps, kv_block=r.kv_block, strategies=tuple(strategies),
                      sd_max_batch=r.sd_max_batch,
                      compact=compact, attention=config.kernels.attention, capture_hidden=capture_hidden,
                      refill=r.refill, suffix_bank_len=r.suffix_bank_len, suffix_ngram=r.suffix_ngram,
                      suffix_history_len=r.suffix_history_len)


def sampling_params(config, tok) -> SamplingParams:
  r = config.rollout
  return SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                        stop_token_ids=(tok.eos_token_id,), seed=config.seed)


def uses_drafter(config) -> bool:
  """Whether the rollout speculates with an EAGLE drafter (else suffix arms alone, or no speculation)."""
  return config.rollout.speculative and any(not s.suffix for s in config_lib.strategies(config))


def check(config) -> None:
  """What the rollouts of a multi-process run need (ValueError naming the key)."""
  if distributed.multiprocess() and not uses_drafter(config):
    raise ValueError("config.rollout.speculative=False or rollout.drafter='suffix': a rollout without an EAGLE "
                     "drafter runs in one process only; several processes run the TLT group engines "
                     "(config.rollout.speculative=True, rollout.drafter='eagle')")
  if distributed.multiprocess() and config.eval.every:
    raise ValueError("config.eval.every: held-out evaluation (a plain engine over all devices) runs in one "
                     "process only; set it to 0 for a multi-process run")


def make(config: ml_collections.ConfigDict, policy: CausalLM, drafter: Drafter | None, tok,
         devices: Sequence[jax.Device]) -> tuple[BaseRollout, BaseRollout | None]:
  """(the RL steps' rollout, the held-out evaluations' or None without `eval.every`) (module docstring).

  Args:
    config: the run's config.
    policy: the policy; its current params are the rollouts' until `set_policy_params`.
    drafter: the EAGLE drafter (None: `uses_drafter(config)` must be False).
    tok: the tokenizer (its EOS stops the responses).
    devices: what the rollouts run on (every process's).
  """
  check(config)
  c = config
  strategies = config_lib.strategies(c) if c.rollout.speculative else ()
  sampling = sampling_params(c, tok)
  make_bandit = lambda: Bandit(strategies, thresholds=config_lib.ints(c.rollout.bandit_thresholds),
                               epsilon=c.rollout.bandit_epsilon, window=c.rollout.bandit_window, seed=c.seed)
  devices = list(devices)
  mesh = sharding.make_mesh({"data": len(devices)}, devices) if len(devices) > 1 else None
  if not uses_drafter(c):
    largest = c.rollout.batch_buckets * c.rollout.groups
    rollout = PlainRollout(policy, engine_config(c, strategies, largest_bucket=largest), sampling, mesh,
                           bandit=make_bandit() if strategies else None)
    return rollout, rollout if c.eval.every else None
  if drafter is None:
    raise ValueError("config.rollout.speculative=True with EAGLE strategies needs a drafter")
  d = c.drafter
  rollout = TLTRollout(
      policy, drafter, engine_config(c, strategies, capture_hidden=True), sampling, devices, c.rollout.groups,
      DataBuffer(BufferConfig(max_pairs=d.buffer_pairs)), TLTConfig(enabled=d.online, solo_steps=d.solo_steps),
      DrafterTrainerConfig(learning_rate=d.online_learning_rate, warmup_steps=d.online_warmup_steps,
                           rows_per_device=d.online_rows_per_device, row_len=d.row_len, seed=c.seed), make_bandit)
  if not c.eval.every:
    return rollout, None
  rows = c.eval.size * c.eval.num_samples
  return rollout, PlainRollout(policy, engine_config(c, largest_bucket=1 << (rows - 1).bit_length(), compact=False),
                               sampling, mesh)
