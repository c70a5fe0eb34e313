"""`check(config)`: a run's config checked whole before anything runs, every problem named by its key."""

from __future__ import annotations

import math
import os
import re

import ml_collections

from tlt_jax import config as config_lib
from tlt_jax import fields, targets
from tlt_jax.config import config_value, eval_set, leaves, renamed
from tlt_jax.drafter.buffer import BufferConfig
from tlt_jax.models import lora
from tlt_jax.rl import builders, corrections, datasets, grpo, rewards, tasks, tools


# Smallest valid value of each numeric key of the sections no dataclass is built from ('>' where a key
# must be strictly above it); the others are checked by their dataclasses. Every float must be finite.
_AT_LEAST = {
    "steps": 0, "policy.lora.rank": 0, "mesh.cpu_devices": 0, "mesh.device_memory_gb": 0, "mesh.dry_run_devices": 1,
    "model.vocab_size": 0, "model.hidden_size": 1, "model.num_layers": 1, "model.num_heads": 1,
    "model.num_kv_heads": 1, "model.head_dim": 1, "model.intermediate_size": 1, "model.max_position_embeddings": 1,
    "task.min_terms": 1, "task.min_digits": 1, "sft.tool_share": 0, "data.size": 1, "data.max_prompt_len": 1,
    "sft.num_problems": 1, "sft.steps": 0, "sft.batch_rows": 1, "sft.row_len": 2, "sft.learning_rate": 0,
    "sft.warmup_steps": 0, "sft.weight_decay": 0, "sft.unanswered": 0, "sft.eval_size": 0, "sft.eval_max_new_tokens": 1,
    "rollout.prompts_per_step": 1, "rollout.num_samples": 1, "rollout.groups": 1, "rollout.mean_response_len": 0,
    "rollout.max_turns": 1, "rollout.tool_workers": 0, "rollout.tool_max_tokens": 2,
    "drafter.draft_vocab_size": -1, "drafter.distill.steps": 0, "drafter.distill.learning_rate": 0,
    "drafter.distill.batch_rows": 1, "drafter.distill.row_len": 2, "drafter.distill.draft_steps": 0,
    "drafter.distill.prompts": 1,
    "rl.mini_batches": 1, "rl.max_skipped_updates": 1, "rl.row_len": 2, "rl.overlong_buffer": 0,
    "rl.advantage_eps": 0, "data.reward_workers": 0, "data.reward_max_failures": 0, "logging.completions_per_step": 0,
    "rl.optimizer.learning_rate": 0, "rl.optimizer.warmup_steps": 0, "rl.optimizer.weight_decay": 0,
    "rl.actor.micro_batch_rows": 1, "rl.actor.logits_chunk": 1, "rl.actor.attention_block": 0,
    "eval.every": 0, "eval.size": 1, "eval.num_samples": 1, "checkpoint.every": 1, "checkpoint.keep": 1,
}
_ABOVE = {"policy.lora.alpha": 0, "rollout.tool_timeout_s": 0,
          "model.rope_theta": 0, "task.tail_alpha": 0, "rl.optimizer.max_grad_norm": 0, "data.reward_timeout_s": 0,
          "drafter.draft_vocab_coverage": 0}
_AT_MOST = {"sft.unanswered": 1, "sft.tool_share": 1, "drafter.draft_vocab_coverage": 1, "data.reward_max_failures": 1}
_CHOICES = {
    "policy.dtype": ("float32", "bfloat16"),
    "policy.weight_dtype": ("float32", "bfloat16"),
    "policy.export_dtype": ("", "float32", "bfloat16"),
    "task.family": tuple(sorted(tasks.FAMILIES)),
    "rl.advantage_std": grpo.ADVANTAGE_STDS,
    "rl.reward_aggregation": grpo.REWARD_AGGREGATIONS,
    "rl.rollout_correction.preset": ("",) + tuple(corrections.PRESETS),
    "rl.old_logp": ("auto", "rollout", "recompute"),
    "rollout.drafter": ("eagle", "suffix"),
}
# Tuple keys and what they hold (a --config override writes a tuple as a Python literal).
_TUPLES = {"rollout.strategies": ("strategy names", str), "rollout.tools": ("tool names", str),
           "rollout.engine.batch_buckets": ("integers", int),
           "rollout.bandit.thresholds": ("integers", int), "drafter.feature_layers": ("integers", int),
           "rl.loss.sapo_temperatures": ("numbers", (int, float)), "rl.loss.vespo": ("numbers", (int, float))}


def check(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first bad key: an old or unknown key, an unset, ill-typed or out-of-range
  value (the dataclasses built from their subtrees check theirs), or sections that do not fit together."""
  def need(ok: bool, key: str, why: str):
    if not ok:
      raise ValueError(f"config.{key}={config_value(config, key)!r}: {why}")
  known = dict(leaves(config_lib.base()))
  for name, s in config.eval.sets.items():  # user-named: each checked against eval_set's keys
    template = eval_set()
    if not isinstance(s, ml_collections.ConfigDict):
      raise ValueError(f"config.eval.sets.{name}: must be a set of keys, e.g. config.eval_set(path=...)")
    known.update({f"eval.sets.{name}.{k}": v for k, v in template.items()})
    for key in ("size", "num_samples", "k"):
      need(isinstance(s[key], int) and s[key] >= (1 if key == "num_samples" else 0), f"eval.sets.{name}.{key}",
           "must be an integer >= " + ("1" if key == "num_samples" else "0"))
    need(s.k <= s.num_samples, f"eval.sets.{name}.k", "must be <= its num_samples")
    need(s.temperature == -1 or s.temperature >= 0, f"eval.sets.{name}.temperature",
         "must be >= 0, or -1 (the rollout's)")
    need(bool(s.path), f"eval.sets.{name}.path", "must name a file")
    need(config.eval.every > 0, "eval.every",
         f"must be > 0: evaluation set {name!r} is evaluated every eval.every steps")
  for key, value in leaves(config):
    if key not in known:
      raise ValueError(renamed(key) or f"config.{key}: unknown key; every key and its default is listed in "
                       "tlt_jax/config.py")
    need(value is not None, key, "must be set")
    need(not isinstance(value, float) or math.isfinite(value), key, "must be a finite number")
  for key, (what, kind) in _TUPLES.items():
    need(all(isinstance(x, kind) and not isinstance(x, bool) for x in config_value(config, key)), key,
         f"must be a tuple of {what}" + (" in quotes, e.g. --config.rollout.strategies=\"('3_1_4','4_2_6')\""
                                         if kind is str else ""))
  for key, low in _AT_LEAST.items():
    need(config_value(config, key) >= low, key, f"must be >= {low}")
  for key, low in _ABOVE.items():
    need(config_value(config, key) > low, key, f"must be > {low}")
  for key, high in _AT_MOST.items():
    need(config_value(config, key) <= high, key, f"must be <= {high}")
  for key, choices in _CHOICES.items():
    need(config_value(config, key) in choices, key, f"must be one of {choices}")
  need(not config.mesh.target or config.mesh.target in targets.names(), "mesh.target",
       f"unknown target; known: {', '.join(targets.names())}")
  for key in ("mesh.data", "mesh.fsdp", "mesh.tensor"):
    need(config_value(config, key) == -1 or config_value(config, key) >= 1, key, "must be >= 1, or -1 (the rest)")
  for prefix in ["data", *(f"eval.sets.{name}" for name in config.eval.sets)]:
    try:
      rewards.check(config_value(config, f"{prefix}.reward"))
    except rewards.RewardError as e:
      need(False, f"{prefix}.reward", str(e))
    try:
      rewards.Reward.of(config_value(config, f"{prefix}.reward"), config_value(config, f"{prefix}.reward_weights"))
    except rewards.RewardError as e:
      need(False, f"{prefix}.reward_weights", str(e))
  for prefix in ["data", *(f"eval.sets.{name}" for name in config.eval.sets)]:
    try:
      datasets.Keys(*(config_value(config, f"{prefix}.{k}") for k in ("prompt_key", "answer_key", "answer_regex",
                                                                        "system_prompt")))
    except ValueError as e:
      need(False, f"{prefix}.answer_regex", str(e))
  need(config.policy.weight_dtype != "bfloat16" or config.policy.dtype == "bfloat16", "policy.weight_dtype",
       "bfloat16 master weights need policy.dtype=bfloat16 (weights narrower than the compute)")
  modules = config.policy.lora.target_modules
  need(isinstance(modules, str) and modules or isinstance(modules, tuple) and modules
       and all(isinstance(t, str) for t in modules), "policy.lora.target_modules",
       "must be 'all-linear', a regex, or a tuple of module names, e.g. \"('q_proj','v_proj')\"")
  if isinstance(modules, str):
    try:
      re.compile(modules)
    except re.error as e:
      need(False, "policy.lora.target_modules", f"not a regular expression ({e})")
  path = config.policy.lora.path
  need(not path or os.path.isfile(os.path.join(path, lora.CONFIG_FILE)), "policy.lora.path",
       f"holds no {lora.CONFIG_FILE} (a PEFT adapter directory, as PeftModel.save_pretrained writes it)")
  for spec in config.rollout.tools:
    try:
      tools.schema(spec)
    except tools.ToolError as e:
      need(False, "rollout.tools", str(e))
  correction = config.rl.rollout_correction
  corrected = correction.preset or correction.is_level or correction.rs
  need(config.rl.old_logp != "rollout" or not corrected, "rl.old_logp",
       "'rollout' makes the old log-probs the rollout's own, so rl.rollout_correction (which weighs the "
       "trainer's against the rollout's) would do nothing: use 'auto' or 'recompute'")
  s = config.rollout.sampling
  need(config.rl.old_logp != "rollout" or not s.top_k and s.top_p >= 1, "rl.old_logp",
       "the rollout's log-probs under top-k / top-p are of a truncated distribution, not the policy's: use "
       "'recompute' or 'auto'")
  need(config.model.num_heads % config.model.num_kv_heads == 0, "model.num_heads",
       "must be a multiple of model.num_kv_heads")
  need(config.task.max_terms >= config.task.min_terms, "task.max_terms", "must be >= task.min_terms")
  need(config.task.max_digits >= config.task.min_digits, "task.max_digits", "must be >= task.min_digits")
  try:
    named = builders.strategies(config)
  except ValueError as e:
    need(False, "rollout.strategies", str(e))
  need(named or not config.rollout.speculative, "rollout.strategies",
       "must name at least one strategy when rollout.speculative (False: the plain baseline)")
  need(len({s.name for s in named}) == len(named), "rollout.strategies", "must not name a strategy twice")
  layers = list(config.drafter.feature_layers)
  need(not layers or (len(layers) == 3 and layers == sorted(set(layers)) and layers[0] >= 0), "drafter.feature_layers",
       "EAGLE-3 needs three increasing target layers (low, mid, high), or none")
  # Each dataclass checks its own fields; a bad one is named by the key that set it.
  for prefix, build, keys in (
      ("rollout.sampling", lambda: builders.sampling_params(config), {}),
      ("rollout.engine", lambda: builders.engine_config(config, named),
       {"max_prompt_len": "data.max_prompt_len", "max_new_tokens": "rollout.sampling.max_new_tokens"}),
      ("rollout.bandit", lambda: builders.bandit(config, named), {}),
      ("rollout.tlt", lambda: builders.tlt_config(config), {}),
      ("drafter.trainer", lambda: builders.drafter_trainer_config(config), {}),
      ("drafter.buffer", lambda: BufferConfig(**config.drafter.buffer), {}),
      ("rl.loss", lambda: builders.objective(config), {}),
      ("rl.rollout_correction", lambda: builders.rollout_correction(config), {})):
    try:
      build()
    except fields.FieldError as e:
      need(False, keys.get(e.field, f"{prefix}.{e.field}"), e.why)
  need(config.rl.row_len >= config.data.max_prompt_len + config.rollout.sampling.max_new_tokens, "rl.row_len",
       "must hold data.max_prompt_len + rollout.sampling.max_new_tokens")
  need(not config.rl.actor.attention_block or config.rl.row_len % config.rl.actor.attention_block == 0,
       "rl.actor.attention_block", "must divide rl.row_len")
  need(not config.eval.every or config.eval.path or not config.data.path, "eval.path",
       "needs a held-out prompt file when data.path is set and eval.every > 0")
