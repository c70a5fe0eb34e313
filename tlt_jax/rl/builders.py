"""What a run's config builds: the rollouts' and the drafter trainer's dataclasses, and the tiny policy's
ModelConfig, each from the config subtree that mirrors it (tlt_jax/config.py)."""

from __future__ import annotations

import dataclasses

from tlt_jax.drafter.trainer import DrafterTrainerConfig
from tlt_jax.models import ModelConfig
from tlt_jax.rollout.bandit import Bandit
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.speculative import Strategy
from tlt_jax.rollout.state import EngineConfig
from tlt_jax.rollout.tlt import TLTConfig
from tlt_jax.rl import corrections, grpo, tools


def strategies(config) -> tuple[Strategy, ...]:
  """The strategies `rollout.strategies` names ('4_1_5' is 's4_1_5' with `rollout.drafter='suffix'`)."""
  suffix_only = config.rollout.drafter == "suffix"
  return tuple(Strategy.parse(name, suffix_only) for name in config.rollout.strategies)


def sampling_params(config, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
  return SamplingParams(**config.rollout.sampling, stop_token_ids=tuple(stop_token_ids), seed=config.seed)


def engine_config(config, strategies: tuple[Strategy, ...] = (), largest_bucket: int | None = None,
                  **engine_fields) -> EngineConfig:
  """`EngineConfig(**rollout.engine)` with the fields other keys set; `largest_bucket`: the buckets 1, 2, 4,
  ... up to it instead of `rollout.engine.batch_buckets` (a power of two); `engine_fields`: the rest."""
  engine = config.rollout.engine.to_dict()
  if largest_bucket is not None:
    engine["batch_buckets"] = tuple(2**i for i in range(largest_bucket.bit_length()))
  return EngineConfig(**engine, max_prompt_len=config.data.max_prompt_len,
                      max_new_tokens=config.rollout.sampling.max_new_tokens, strategies=tuple(strategies),
                      **engine_fields)


def model_config(config, tokenizer=None) -> ModelConfig:
  """`model.*` as a ModelConfig: the architecture's switches as its config.json gives them (Qwen2's q/k/v
  bias, Qwen3's q/k norm), the layers as `policy.scan_layers` says. With the `tokenizer` a new policy is
  built for: its special tokens, and its size as the vocabulary when `model.vocab_size` is 0 (a larger
  one pads it, e.g. to a real model's LM-head shape)."""
  m = config.model
  vocab = m.vocab_size or (len(tokenizer) if tokenizer is not None else 0)
  if not vocab:
    raise ValueError("config.model.vocab_size: needed without a tokenizer (0 means the tokenizer's size)")
  if tokenizer is not None and vocab < len(tokenizer):
    raise ValueError(f"config.model.vocab_size={vocab}: smaller than the tokenizer's {len(tokenizer)} tokens")
  hf = {"architectures": [m.architecture], "vocab_size": vocab, "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
        "max_position_embeddings": m.max_position_embeddings, "rope_theta": m.rope_theta,
        "tie_word_embeddings": m.tie_word_embeddings}
  if tokenizer is not None:
    hf.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id)
  return dataclasses.replace(ModelConfig.from_hf(hf, source="config.model"), scan_layers=config.policy.scan_layers)


def bandit(config, strategies: tuple[Strategy, ...]) -> Bandit:
  return Bandit(strategies, **config.rollout.bandit, seed=config.seed)


def tlt_config(config) -> TLTConfig:
  return TLTConfig(**config.rollout.tlt)


def drafter_trainer_config(config) -> DrafterTrainerConfig:
  return DrafterTrainerConfig(**config.drafter.trainer, temperature=config.rollout.sampling.temperature,
                              seed=config.seed)


def tool_schemas(config) -> list[dict] | None:
  """The JSON schemas of `rollout.tools`, which every prompt shows; None without tools."""
  return [tools.schema(spec) for spec in config.rollout.tools] or None


def tool_turns(config, tok, workers: int | None = None) -> tools.ToolTurns | None:
  """The runner of `rollout.tools`' calls (`workers`: `rollout.tool_workers` unless given); None without tools."""
  if not config.rollout.tools:
    return None
  r = config.rollout
  return tools.ToolTurns(r.tools, tok, max_turns=r.max_turns, timeout_s=r.tool_timeout_s,
                         workers=r.tool_workers if workers is None else workers, max_tokens=r.tool_max_tokens)


def objective(config) -> grpo.Objective:
  return grpo.Objective(**config.rl.loss)


def rollout_correction(config) -> corrections.RolloutCorrection:
  """`rl.rollout_correction`: a preset's values where the keys are at their defaults, then the keys."""
  keys = {k: v for k, v in config.rl.rollout_correction.items() if k != "preset"}
  preset = config.rl.rollout_correction.preset
  if preset:
    defaults = corrections.RolloutCorrection()
    keys.update({k: v for k, v in corrections.PRESETS[preset].items() if keys[k] == getattr(defaults, k)})
  return corrections.RolloutCorrection(**keys)
