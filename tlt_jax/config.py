"""Every key `python -m tlt_jax.main` understands, with defaults; experiment configs start from `base()`.

This file is also the CLIs' default config file: its `get_config()` is the tiny world (configs/tiny.py),
found inside the installed package.

A config file is `get_config()` returning `base()` with its values set. The returned ConfigDict is
locked, so a mistyped key in a config file or in a `--config.key=value` override is an error that
names the key, and `check` rejects values that would fail later (naming the key).
"""

from __future__ import annotations

import math
import os

import jax
import ml_collections
from absl import logging
from jax.experimental.compilation_cache import compilation_cache

from tlt_jax.kernels import tree_attention
from tlt_jax.rl import grpo
from tlt_jax.rl import rewards
from tlt_jax.rl import tasks
from tlt_jax.rollout import sampling
from tlt_jax.rollout.speculative import Strategy


def base() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = "runs/tiny"
  c.seed = 0
  c.steps = 20  # RL steps
  c.dry_run = False  # compile and size everything for the mesh, read no weights, run nothing

  c.mesh = ml_collections.ConfigDict()
  c.mesh.cpu_devices = 0  # > 0: simulate this many CPU devices (tests, laptops); 0: the real devices
  c.mesh.data = -1  # trainer mesh axes (sharding.MESH_AXES); one may be -1 (the rest)
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.mesh.device_memory_gb = 0.0  # dry run: fail if an executable needs more per device (0: no check)
  c.mesh.dry_run_devices = 8  # a dry run on a CPU-only machine simulates this many devices

  c.distributed = ml_collections.ConfigDict()
  c.distributed.enabled = False  # jax.distributed.initialize(); also when the environment says multi-host
  c.distributed.coordinator_address = ""  # "" = from the environment (Slurm, Kubernetes, Cloud TPU)
  c.distributed.num_processes = 0
  c.distributed.process_id = -1

  # The policy: a local Hugging Face directory. Empty: the tiny world's policy (model/sft below),
  # trained by SFT into <workdir>/policy unless it is already there.
  c.policy = ml_collections.ConfigDict()
  c.policy.path = ""
  c.policy.dtype = "float32"  # parameter dtype for training and rollout
  # Decoder layers stacked and run by one lax.scan: every executable compiles one layer body.
  # False: unrolled (docs/BENCHMARKS.md, "Scanned vs unrolled layers"). Checkpoints hold one form.
  c.policy.scan_layers = True

  # Architecture of the tiny policy (Qwen3, tied embeddings); also the shape a dry run uses when
  # policy.path has no config.json (e.g. sizing a cluster run on a laptop).
  c.model = ml_collections.ConfigDict()
  c.model.architecture = "Qwen3ForCausalLM"
  c.model.vocab_size = 0  # 0: the tokenizer's size
  c.model.hidden_size = 96
  c.model.num_layers = 6
  c.model.num_heads = 3
  c.model.num_kv_heads = 1
  c.model.head_dim = 32
  c.model.intermediate_size = 384
  c.model.max_position_embeddings = 1024
  c.model.rope_theta = 10000.0
  c.model.tie_word_embeddings = True

  # Prompts: procedural reasoning-gym tasks, or a local JSONL / Parquet file (data.path).
  c.task = ml_collections.ConfigDict()
  c.task.family = "basic_arithmetic"
  c.task.min_terms = 2
  c.task.max_terms = 24
  c.task.tail_alpha = 1.0
  c.data = ml_collections.ConfigDict()
  c.data.path = ""  # "" = procedural tasks (task.*)
  c.data.size = 4096  # procedural prompts
  c.data.max_prompt_len = 128
  c.data.reward = "reasoning_gym"  # rewards.REWARDS

  c.sft = ml_collections.ConfigDict()  # the tiny policy's warm start (tlt_jax.sft)
  c.sft.num_problems = 20000
  c.sft.steps = 240
  c.sft.batch_rows = 16
  c.sft.row_len = 256
  c.sft.learning_rate = 5e-3
  c.sft.warmup_steps = 30
  c.sft.weight_decay = 0.01
  c.sft.eval_size = 256
  c.sft.eval_max_new_tokens = 384
  c.sft.unanswered = 0.0  # fraction of SFT solutions without their `Answer:` line (a sloppy teacher)

  c.rollout = ml_collections.ConfigDict()
  c.rollout.speculative = True  # False: the plain-rollout baseline, everything else equal
  c.rollout.prompts_per_step = 16
  c.rollout.num_samples = 8  # responses per prompt (the GRPO group)
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0
  c.rollout.max_new_tokens = 384
  c.rollout.groups = 1  # data-parallel rollout groups (each its devices' share of the prompts)
  c.rollout.batch_buckets = 128  # largest batch bucket per rollout group (powers of two below it)
  c.rollout.refill = True  # more rows than that bucket: refill finished rows' slots (False: consecutive waves)
  c.rollout.segment_steps = 16
  c.rollout.kv_block = 64
  c.rollout.strategies = "3_1_4,4_2_6"  # draft depth_topk_verify, comma-separated (bandit arms beside SD off)
  # "eagle": the EAGLE drafter (warmed up, trained online); 's'-strategies (e.g. "s4_1_5") are suffix
  # arms beside its own. "suffix": no drafter model, the strategies' shapes draft suffix matches in
  # each prompt's token bank (its prompt and its samples' tokens): no forward pass per draft.
  c.rollout.drafter = "eagle"
  c.rollout.suffix_bank_len = 4096  # tokens banked per prompt in flight at most
  c.rollout.suffix_ngram = 4  # the longest suffix of a row's tokens matched in its bank
  # Tokens of each prompt's responses in earlier steps (epochs) banked with it for suffix drafts, the
  # newest first (0: off); host memory: 4 bytes x this x prompts seen, checkpointed.
  c.rollout.suffix_history_len = 0
  c.rollout.sd_max_batch = 32  # speculate only while at most this many rows are active
  c.rollout.bandit_thresholds = "1,2,5,21"
  c.rollout.bandit_epsilon = 0.1
  c.rollout.bandit_window = 300
  c.rollout.compilation_cache_dir = ""  # persistent XLA cache, set at start-up: later runs skip compiling

  c.kernels = ml_collections.ConfigDict()
  c.kernels.attention = "auto"  # tree attention of rollouts: auto (by backend) | xla | pallas | pallas_tpu | pallas_gpu

  c.drafter = ml_collections.ConfigDict()
  c.drafter.path = ""  # a drafter checkpoint (tlt_jax.train_drafter); "" = <workdir>/drafter, warmed up if absent
  c.drafter.feature_layers = ""  # EAGLE-3: comma-separated target layers; "" = EAGLE (final hidden state)
  c.drafter.draft_vocab_size = 0  # a warmed-up drafter's reduced head: the N most frequent tokens; 0 = full vocabulary
  c.drafter.warmup_steps = 200  # offline distillation on the SFT data when no drafter exists
  c.drafter.learning_rate = 3e-3
  c.drafter.batch_rows = 16
  c.drafter.row_len = 256  # packed row length of warm-up and online training
  c.drafter.online = True  # spot training on idle rollout groups (False: the drafter stays frozen)
  c.drafter.online_learning_rate = 1e-3
  c.drafter.online_warmup_steps = 20
  c.drafter.online_rows_per_device = 2
  c.drafter.solo_steps = 8  # one rollout group: drafter steps in the gap after each rollout
  c.drafter.buffer_pairs = 1 << 18  # bound of the online data buffer

  c.rl = ml_collections.ConfigDict()
  c.rl.learning_rate = 1e-4
  c.rl.warmup_steps = 0
  c.rl.weight_decay = 0.0
  c.rl.max_grad_norm = 1.0
  c.rl.mini_batches = 2  # optimizer updates per step (later ones are off-policy: the ratio clips)
  c.rl.micro_batch_rows = 8  # packed rows per forward/backward (gradient accumulation)
  c.rl.row_len = 512  # packed row length; must hold the longest prompt + response
  c.rl.remat = False  # recompute each layer in the backward pass (long rows)
  c.rl.logits_chunk = 1024  # LM-head positions at a time in the loss (bounds the [T, vocab] logits)
  c.rl.attention_block = 0  # > 0: attention over this many queries at a time (bounds [T, T] scores)
  c.rl.clip_low = 0.2
  c.rl.clip_high = 0.28  # DAPO clip-higher
  c.rl.loss_aggregation = "token"  # grpo.AGGREGATIONS
  c.rl.normalize_std = True
  c.rl.kl_coef = 0.0  # > 0: low-variance KL to the frozen initial policy
  c.rl.dynamic_sampling = True  # drop groups whose rewards are all equal
  c.rl.overlong_filter = False  # truncated responses do not enter the loss
  c.rl.overlong_buffer = 0  # DAPO soft overlong penalty over the last this-many tokens (0: off)
  # Updates with a non-finite loss or gradient are skipped; this many in a row stop the run (diverged).
  c.rl.max_skipped_updates = 3

  # Held-out evaluation: the same prompts and sampling keys every time, so evaluations compare.
  c.eval = ml_collections.ConfigDict()
  c.eval.every = 0  # > 0: before the first step, every this many steps and after the last (0: off)
  c.eval.path = ""  # held-out prompt file; "" = eval.size procedural problems of another seed
  c.eval.size = 128  # prompts (the first this many of eval.path)
  c.eval.num_samples = 4  # responses per prompt, sampled like the rollout's

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 5  # steps
  c.checkpoint.keep = 2
  return c


def smoke(c: ml_collections.ConfigDict) -> None:
  """Seconds-sized shapes (`get_config("smoke")` of a config file): a 2-layer tiny policy, short prompts
  and responses, one RL step on one device (one rollout group). For notebook smoke runs and tests."""
  c.steps = 1
  c.model.hidden_size, c.model.num_layers, c.model.intermediate_size = 32, 2, 64
  c.mesh.cpu_devices = 1
  c.task.max_terms = 4
  c.data.size = 64
  c.data.max_prompt_len = 64
  c.sft.num_problems, c.sft.steps, c.sft.batch_rows, c.sft.row_len, c.sft.warmup_steps = 256, 10, 4, 128, 2
  r = c.rollout
  r.groups, r.prompts_per_step, r.num_samples, r.max_new_tokens = 1, 1, 2, 24  # batch buckets 1 and 2
  r.batch_buckets, r.segment_steps, r.kv_block, r.strategies, r.sd_max_batch = 2, 8, 32, "2_1_3", 2
  d = c.drafter
  d.warmup_steps, d.batch_rows, d.row_len, d.online_rows_per_device, d.online_warmup_steps, d.solo_steps = \
      4, 4, 64, 1, 1, 2
  c.rl.row_len, c.rl.micro_batch_rows, c.rl.mini_batches, c.rl.warmup_steps = 96, 4, 1, 0
  c.eval.every = 0


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """The tiny world, the default `--config` (this file; configs/tiny.py says more): a 0.8M-parameter
  Qwen3-architecture policy on procedural arithmetic, RL with TLT on a CPU in minutes.

  `variant="smoke"`: the same pipeline at seconds-sized shapes (notebook smoke runs, tests).
  """
  c = base()
  c.workdir = "runs/tiny"
  c.steps = 20
  # 0.8M parameters: on a 2-core CPU training is compute-bound, and in the 3-minute budget this
  # size learns the task far better than a 1.5M one (31-48% vs 7% held-out accuracy).
  c.model.hidden_size = 96
  c.model.num_layers = 6  # deep enough that a one-layer drafter is cheap beside it
  c.model.num_heads = 3
  c.model.num_kv_heads = 1
  c.model.head_dim = 32
  c.model.intermediate_size = 384
  c.model.max_position_embeddings = 1024

  # Two simulated CPU devices, one rollout group each: a group that finishes its share trains
  # the drafter while the other decodes its tail.
  c.mesh.cpu_devices = 2
  c.rollout.groups = 2
  c.rollout.prompts_per_step = 32  # x 8 samples = 256 rollouts per step, 128 per group
  c.rollout.batch_buckets = 128
  c.rollout.max_new_tokens = 256
  c.rollout.strategies = "5_2_8"  # the bandit plays it against SD off per batch-size bucket
  c.rollout.sd_max_batch = 16
  c.rollout.compilation_cache_dir = "runs/xla_cache"  # later runs skip compiling
  c.sft.unanswered = 0.3
  c.drafter.warmup_steps = 200
  c.rl.row_len = 384
  c.rl.learning_rate = 1e-4
  c.rl.warmup_steps = 10
  c.rl.mini_batches = 4
  c.eval.every = 10  # held-out reward before the first step, at step 10 and at the end
  c.eval.size = 64
  if variant == "smoke":
    smoke(c)
  elif variant:
    raise ValueError(f"the tiny config: unknown variant {variant!r} (known: smoke)")
  c.lock()
  return c


def ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(",") if x.strip())


def strategies(config) -> tuple[Strategy, ...]:
  suffix_only = config.rollout.drafter == "suffix"
  return tuple(Strategy.parse(s.strip(), suffix_only) for s in config.rollout.strategies.split(",") if s.strip())


# Smallest valid value of each numeric key ('>' where a key must be strictly above it); every float
# must also be finite.
_AT_LEAST = {
    "steps": 0, "mesh.cpu_devices": 0, "mesh.device_memory_gb": 0, "mesh.dry_run_devices": 1,
    "model.vocab_size": 0, "model.hidden_size": 1, "model.num_layers": 1, "model.num_heads": 1,
    "model.num_kv_heads": 1, "model.head_dim": 1, "model.intermediate_size": 1, "model.max_position_embeddings": 1,
    "task.min_terms": 1, "data.size": 1, "data.max_prompt_len": 1,
    "sft.num_problems": 1, "sft.steps": 0, "sft.batch_rows": 1, "sft.row_len": 2, "sft.learning_rate": 0,
    "sft.warmup_steps": 0, "sft.weight_decay": 0, "sft.unanswered": 0, "sft.eval_size": 0, "sft.eval_max_new_tokens": 1,
    "rollout.prompts_per_step": 1, "rollout.num_samples": 1, "rollout.groups": 1, "rollout.segment_steps": 1,
    "rollout.kv_block": 1,
    "rollout.sd_max_batch": 1, "rollout.bandit_epsilon": 0, "rollout.bandit_window": 1, "rollout.suffix_ngram": 1,
    "rollout.suffix_bank_len": 2, "rollout.suffix_history_len": 0,
    "drafter.draft_vocab_size": 0, "drafter.warmup_steps": 0, "drafter.learning_rate": 0, "drafter.batch_rows": 1,
    "drafter.row_len": 2,
    "drafter.online_learning_rate": 0, "drafter.online_warmup_steps": 0, "drafter.online_rows_per_device": 1,
    "drafter.solo_steps": 0, "drafter.buffer_pairs": 1,
    "rl.learning_rate": 0, "rl.warmup_steps": 0, "rl.weight_decay": 0, "rl.mini_batches": 1,
    "rl.max_skipped_updates": 1,
    "rl.micro_batch_rows": 1, "rl.row_len": 2, "rl.logits_chunk": 1, "rl.attention_block": 0, "rl.clip_low": 0,
    "rl.clip_high": 0, "rl.kl_coef": 0, "rl.overlong_buffer": 0, "eval.every": 0, "eval.size": 1, "eval.num_samples": 1,
    "checkpoint.every": 1, "checkpoint.keep": 1,
}
_ABOVE = {"model.rope_theta": 0, "task.tail_alpha": 0, "rl.max_grad_norm": 0}
_AT_MOST = {"sft.unanswered": 1, "rollout.bandit_epsilon": 1}
# rollout.* keys checked by SamplingParams' own bounds.
_SAMPLING = ("temperature", "top_k", "top_p", "max_new_tokens")
_CHOICES = {
    "policy.dtype": ("float32", "bfloat16"),
    "task.family": tuple(sorted(tasks.FAMILIES)),
    "data.reward": tuple(sorted(rewards.REWARDS)),
    "kernels.attention": tree_attention.IMPLEMENTATIONS,
    "rl.loss_aggregation": grpo.AGGREGATIONS,
    "rollout.drafter": ("eagle", "suffix"),
}


def check(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first bad key."""
  def need(ok: bool, key: str, why: str):
    if not ok:
      raise ValueError(f"config.{key}={config_value(config, key)!r}: {why}")
  for key, value in leaves(config):
    need(value is not None, key, "must be set")
    need(not isinstance(value, float) or math.isfinite(value), key, "must be a finite number")
  for field in _SAMPLING:
    try:
      sampling.check_field(field, config.rollout[field])
    except ValueError as e:
      need(False, f"rollout.{field}", str(e))
  for key, low in _AT_LEAST.items():
    need(config_value(config, key) >= low, key, f"must be >= {low}")
  for key, low in _ABOVE.items():
    need(config_value(config, key) > low, key, f"must be > {low}")
  for key, high in _AT_MOST.items():
    need(config_value(config, key) <= high, key, f"must be <= {high}")
  for key, choices in _CHOICES.items():
    need(config_value(config, key) in choices, key, f"must be one of {choices}")
  for key in ("mesh.data", "mesh.fsdp", "mesh.tensor"):
    need(config_value(config, key) == -1 or config_value(config, key) >= 1, key, "must be >= 1, or -1 (the rest)")
  need(config.model.num_heads % config.model.num_kv_heads == 0, "model.num_heads",
       "must be a multiple of model.num_kv_heads")
  need(config.task.max_terms >= config.task.min_terms, "task.max_terms", "must be >= task.min_terms")
  b = config.rollout.batch_buckets
  need(b >= 1 and b & (b - 1) == 0, "rollout.batch_buckets", "must be a power of two")
  try:
    named = strategies(config)
  except ValueError as e:
    raise ValueError(f"config.rollout.strategies={config.rollout.strategies!r}: {e}") from None
  need(named or not config.rollout.speculative, "rollout.strategies",
       "must name at least one strategy when rollout.speculative (False: the plain baseline)")
  need(len({s.name for s in named}) == len(named), "rollout.strategies", "must not name a strategy twice")
  need(not any(s.suffix for s in named)
       or config.rollout.suffix_bank_len >= config.data.max_prompt_len + config.rollout.suffix_history_len + 2,
       "rollout.suffix_bank_len", "must hold data.max_prompt_len + rollout.suffix_history_len + 2 (the prompt, its "
       "history and a token)")
  for key in ("rollout.bandit_thresholds", "drafter.feature_layers"):
    try:
      ints(config_value(config, key))
    except ValueError:
      raise ValueError(f"config.{key}={config_value(config, key)!r}: must be comma-separated integers") from None
  layers = list(ints(config.drafter.feature_layers))
  need(not layers or (len(layers) == 3 and layers == sorted(set(layers)) and layers[0] >= 0), "drafter.feature_layers",
       "EAGLE-3 needs three increasing target layers (low,mid,high), or none")
  thresholds = ints(config.rollout.bandit_thresholds)
  need(thresholds[:1] == (1,) and all(a < b for a, b in zip(thresholds, thresholds[1:])), "rollout.bandit_thresholds",
       "must increase from 1")
  need(config.rl.row_len >= config.data.max_prompt_len + config.rollout.max_new_tokens, "rl.row_len",
       "must hold data.max_prompt_len + rollout.max_new_tokens")
  need(config.rl.clip_low < 1, "rl.clip_low", "must be < 1")
  need(not config.rl.attention_block or config.rl.row_len % config.rl.attention_block == 0, "rl.attention_block",
       "must divide rl.row_len")
  need(not config.eval.every or config.eval.path or not config.data.path, "eval.path",
       "needs a held-out prompt file when data.path is set and eval.every > 0")


def leaves(config, prefix=""):
  """(dotted key, value) of every leaf."""
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from leaves(value, f"{prefix}{key}.")
    else:
      yield prefix + key, value


def config_value(config, key: str):
  for part in key.split("."):
    config = config[part]
  return config


def setup_devices(config) -> None:
  """Simulated CPU devices, the multi-process runtime and the compilation cache, before any computation."""
  cpu_devices = config.mesh.dry_run_devices if config.dry_run else config.mesh.cpu_devices
  if cpu_devices:  # only the CPU backend's device count: on an accelerator host this changes nothing
    jax.config.update("jax_num_cpu_devices", cpu_devices)
  d = config.distributed
  if d.enabled or _multi_host_environment():
    kwargs = {}
    if d.coordinator_address:  # else jax finds them in the Slurm / Kubernetes / Cloud TPU environment
      kwargs = dict(coordinator_address=d.coordinator_address, num_processes=d.num_processes, process_id=d.process_id)
    jax.distributed.initialize(**kwargs)
    logging.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
  setup_compilation_cache(config.rollout.compilation_cache_dir)


def setup_compilation_cache(path: str) -> None:
  """Points JAX's persistent compilation cache at `path` ("": leaves it as it is), caching every
  executable: later processes load what this one compiles. Process-wide: call it once at start-up."""
  previous = jax.config.jax_compilation_cache_dir
  if not path or previous == path:
    return
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  if previous:  # JAX opens the cache once per process: make it open the new dir
    compilation_cache.reset_cache()


def _multi_host_environment() -> bool:
  return int(os.environ.get("SLURM_NTASKS", "1")) > 1 or "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
