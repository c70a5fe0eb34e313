"""Every key `python -m tlt_jax.main` understands, with defaults; experiment configs start from `base()`.

This file is also the CLIs' default config file: its `get_config()` is the tiny world (configs/tiny.py),
found inside the installed package.

A config file is `get_config()` returning `base()` with its values set. The returned ConfigDict is
locked, so a mistyped key in a `--config.key=value` override is an error that names the key, and
`check` rejects keys base() does not have (an old key: naming its new name, `RENAMED`) and values
that would fail later (naming the key).

A subtree that builds a dataclass mirrors it: `SamplingParams(**rollout.sampling, ...)`,
`EngineConfig(**rollout.engine, ...)`, `Bandit(strategies, **rollout.bandit)`, `TLTConfig(**rollout.tlt)`,
`DrafterTrainerConfig(**drafter.trainer, ...)`, `BufferConfig(**drafter.buffer)`,
`actor.make_optimizer(**rl.optimizer)`, `actor.Actor(policy, optimizer, **rl.actor)` (the builders below;
tlt_jax.rl.rollouts uses them); the dataclasses check their own fields' ranges (`check` re-raises their
errors naming the key) and `check` the rest. Tuples are tuples; on the command line they are Python
literals, strings quoted: `--config.rollout.strategies="('3_1_4','4_2_6')"`,
`--config.rollout.engine.batch_buckets="(1,2,4,8)"`, `--config.drafter.feature_layers="(1,3,5)"`.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import ml_collections
from absl import logging
from jax.experimental.compilation_cache import compilation_cache

from tlt_jax import fields
from tlt_jax.drafter.buffer import BufferConfig
from tlt_jax.drafter.trainer import DrafterTrainerConfig
from tlt_jax.models import ModelConfig
from tlt_jax.rl import datasets
from tlt_jax.rl import grpo
from tlt_jax.rl import rewards
from tlt_jax.rl import tasks
from tlt_jax.rollout.bandit import Bandit
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.speculative import Strategy
from tlt_jax.rollout.state import EngineConfig
from tlt_jax.rollout.tlt import TLTConfig


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
  # Precision. `dtype` computes (matmul inputs, activations, KV caches) and rolls out: the rollout engines
  # and the drafter read a copy of the policy in it, cast once per step after the update. `weight_dtype`
  # holds the trainer's master weights and AdamW moments (sharded; checkpointed): float32 (mixed precision,
  # the default: log-softmax, loss and gradients in float32 too), or bfloat16 (pure bfloat16, half the
  # optimizer memory, its updates stochastically rounded so that small ones still move the weights).
  c.policy.dtype = "float32"
  c.policy.weight_dtype = "float32"
  c.policy.export_dtype = ""  # the exported policy's; "" = policy.path's own (else policy.dtype)
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
  c.data.path = ""  # "" = procedural tasks (task.*); a .jsonl / .parquet file or a datasets.save_to_disk directory
  c.data.size = 4096  # procedural prompts
  c.data.max_prompt_len = 128
  # Where a file's rows hold what a prompt needs (tlt_jax.rl.datasets.Keys): "" = the usual names
  # (prompt / question / problem; reward_model.ground_truth, ground_truth / answer / solution).
  c.data.prompt_key = ""
  c.data.answer_key = ""  # a dotted path into the row, e.g. "reward_model.ground_truth"
  c.data.answer_regex = ""  # its first group is the ground truth, e.g. "#### (.*)" for GSM8K's answers
  c.data.system_prompt = ""  # a system turn before every prompt that has none
  # What scores a response (tlt_jax.rl.rewards): a built-in (reasoning_gym, math_verify, format, auto),
  # "path/to/file.py:function" or "package.module:function" with verl's signature
  # compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict.
  c.data.reward = "reasoning_gym"
  c.data.reward_workers = 4  # worker processes scoring rewards (0: in the trainer's process, no timeout)
  c.data.reward_timeout_s = 60.0  # a call that takes longer scores 0 and is counted

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
  c.rollout.groups = 1  # data-parallel rollout groups (each its devices' share of the prompts)
  # Draft strategies depth_topk_verify (bandit arms beside SD off). With drafter "eagle" (the EAGLE
  # drafter, warmed up, trained online), 's'-strategies (e.g. "s4_1_5") are suffix arms beside its
  # own; with "suffix" (no drafter model) the strategies' shapes draft suffix matches in each
  # prompt's token bank (its prompt and its samples' tokens): no forward pass per draft.
  c.rollout.strategies = ("3_1_4", "4_2_6")
  c.rollout.drafter = "eagle"
  c.rollout.mean_response_len = 0  # what the dry run sizes a paged KV cache for (0: max_new_tokens / 4)
  c.rollout.compilation_cache_dir = ""  # persistent XLA cache, set at start-up: later runs skip compiling
  c.rollout.sampling = ml_collections.ConfigDict()  # SamplingParams (stop tokens: the tokenizer's EOS)
  c.rollout.sampling.temperature = 1.0
  c.rollout.sampling.top_p = 1.0
  c.rollout.sampling.top_k = 0
  c.rollout.sampling.max_new_tokens = 384
  c.rollout.engine = ml_collections.ConfigDict()  # EngineConfig of each rollout group
  c.rollout.engine.batch_buckets = (1, 2, 4, 8, 16, 32, 64, 128)  # rows at once: 1, 2, 4, ... up to the largest
  c.rollout.engine.refill = True  # more rows than the largest bucket: refill finished rows' slots (False: waves)
  c.rollout.engine.segment_steps = 16
  c.rollout.engine.kv_block = 64
  c.rollout.engine.sd_max_batch = 32  # speculate only while at most this many rows are active
  c.rollout.engine.suffix_bank_len = 4096  # tokens banked per prompt in flight at most
  c.rollout.engine.suffix_ngram = 4  # the longest suffix of a row's tokens matched in its bank
  # Tokens of each prompt's earlier-epoch responses banked for suffix drafts (0: off); host memory:
  # 4 bytes x this x prompts seen, checkpointed.
  c.rollout.engine.suffix_history_len = 0
  # Tree attention: auto (by backend) | xla | pallas | pallas_tpu | pallas_gpu | triton (NVIDIA GPU only).
  c.rollout.engine.attention = "auto"
  # Paged KV cache: 0 gives each row its whole capacity; > 0 (a multiple of kv_block), rows share a
  # pool of num_pages pages of this many slots (0: what the largest bucket's rows could fill) and a
  # prompt's samples share its prompt's pages. The dry run reports how many rows a pool holds.
  c.rollout.engine.page_size = 0
  c.rollout.engine.num_pages = 0
  c.rollout.bandit = ml_collections.ConfigDict()  # Bandit over the strategies and SD off
  c.rollout.bandit.thresholds = (1, 2, 5, 21)  # active-row buckets: 1, 2-4, 5-20, 21+
  c.rollout.bandit.epsilon = 0.1
  c.rollout.bandit.window = 300
  c.rollout.tlt = ml_collections.ConfigDict()  # TLTConfig: the TLT rollout's schedule of rollout groups
  c.rollout.tlt.enabled = True  # idle groups train the drafter (False: it stays frozen)
  c.rollout.tlt.solo_steps = 8  # one rollout group: drafter steps in the gap after each rollout

  c.drafter = ml_collections.ConfigDict()
  c.drafter.path = ""  # a drafter checkpoint (tlt_jax.train_drafter); "" = <workdir>/drafter, distilled if absent
  c.drafter.feature_layers = ()  # EAGLE-3: three target layers (low, mid, high); () = EAGLE (final hidden state)
  # A distilled drafter's head: -1 the smallest one whose most frequent tokens cover draft_vocab_coverage of
  # the warm-up's response tokens (the whole vocabulary when that is not smaller), 0 the whole vocabulary,
  # N the N most frequent tokens.
  c.drafter.draft_vocab_size = -1
  c.drafter.draft_vocab_coverage = 0.99
  c.drafter.distill = ml_collections.ConfigDict()  # the warm-up when no drafter exists (bootstrap.load_drafter)
  c.drafter.distill.steps = 200
  c.drafter.distill.learning_rate = 3e-3
  c.drafter.distill.batch_rows = 16
  c.drafter.distill.row_len = 256  # packed row length
  c.drafter.distill.draft_steps = 1  # training-time test: draft steps trained on the drafter's own features
  c.drafter.distill.prompts = 256  # a pretrained policy's warm-up: its responses to this many training prompts
  c.drafter.trainer = ml_collections.ConfigDict()  # DrafterTrainerConfig: online training on idle rollout groups
  c.drafter.trainer.learning_rate = 1e-3
  c.drafter.trainer.warmup_steps = 20  # learning-rate warm-up
  c.drafter.trainer.rows_per_device = 2
  c.drafter.trainer.row_len = 256  # packed row length
  c.drafter.trainer.draft_steps = 1  # training-time test steps of each online update
  c.drafter.buffer = ml_collections.ConfigDict()  # BufferConfig of the online data
  c.drafter.buffer.max_pairs = 1 << 18

  c.rl = ml_collections.ConfigDict()
  c.rl.mini_batches = 2  # optimizer updates per step (later ones are off-policy: the ratio clips)
  c.rl.row_len = 512  # packed row length; must hold the longest prompt + response
  c.rl.loss_aggregation = "token"  # grpo.AGGREGATIONS: token (DAPO), sequence (GRPO), constant (Dr. GRPO)
  # Group advantages (r - mean) / (std + eps): the sample std as verl and TRL take it, the population
  # std, or none (Dr. GRPO). TRL's eps is 1e-4, verl's 1e-6.
  c.rl.advantage_std = "sample"
  c.rl.advantage_eps = 1e-6
  c.rl.dynamic_sampling = True  # drop groups whose rewards are all equal
  c.rl.overlong_filter = False  # truncated responses do not enter the loss
  c.rl.overlong_buffer = 0  # DAPO soft overlong penalty over the last this-many tokens (0: off)
  # Updates with a non-finite loss or gradient are skipped; this many in a row stop the run (diverged).
  c.rl.max_skipped_updates = 3
  # Truncated importance sampling for the training-inference mismatch (verl's TIS): each token's policy
  # loss weighed by min(p_trainer / p_rollout, tis_cap) of the rollout's own log-probs (0: off).
  c.rl.tis_cap = 0.0
  c.rl.optimizer = ml_collections.ConfigDict()  # actor.make_optimizer: AdamW after global-norm clipping
  c.rl.optimizer.learning_rate = 1e-4
  c.rl.optimizer.warmup_steps = 0  # learning-rate warm-up
  c.rl.optimizer.weight_decay = 0.0
  c.rl.optimizer.max_grad_norm = 1.0
  c.rl.actor = ml_collections.ConfigDict()  # actor.Actor
  c.rl.actor.micro_batch_rows = 8  # packed rows per forward/backward (gradient accumulation)
  c.rl.actor.clip_low = 0.2
  c.rl.actor.clip_high = 0.28  # DAPO clip-higher
  c.rl.actor.kl_coef = 0.0  # > 0: low-variance KL to the frozen initial policy
  c.rl.actor.remat = False  # recompute each layer in the backward pass (long rows)
  c.rl.actor.logits_chunk = 1024  # LM-head positions at a time in the loss (bounds the [T, vocab] logits)
  c.rl.actor.attention_block = 0  # > 0: attention over this many queries at a time (bounds [T, T] scores)

  # Held-out evaluation: the same prompts and sampling keys every time, so evaluations compare.
  c.eval = ml_collections.ConfigDict()
  c.eval.every = 0  # > 0: before the first step, every this many steps and after the last (0: off)
  c.eval.path = ""  # held-out prompt file; "" = eval.size procedural problems of another seed
  c.eval.size = 128  # prompts (the first this many of eval.path)
  c.eval.num_samples = 4  # responses per prompt, sampled like the rollout's (pass@k: k = this)
  # More named evaluation sets, each a file of its own: c.eval.sets.<name> = config.eval_set(path=..., ...)
  # (a config file; the README's "Your own task"). Each reports its mean reward, pass@1 and pass@k.
  c.eval.sets = ml_collections.ConfigDict()

  # Metrics go to <workdir>/metrics.jsonl and TensorBoard; with `wandb`, to a Weights & Biases run too
  # (pip install 'tlt_jax[wandb]'; WANDB_MODE=offline keeps it on disk). Its name: the workdir's if "".
  c.logging = ml_collections.ConfigDict()
  c.logging.wandb = False
  c.logging.wandb_project = "tlt_jax"
  c.logging.wandb_entity = ""
  c.logging.wandb_run = ""

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
  r.groups, r.prompts_per_step, r.num_samples, r.sampling.max_new_tokens, r.strategies = 1, 1, 2, 24, ("2_1_3",)
  r.engine.batch_buckets, r.engine.segment_steps, r.engine.kv_block, r.engine.sd_max_batch = (1, 2), 8, 32, 2
  c.drafter.distill.steps, c.drafter.distill.batch_rows, c.drafter.distill.row_len = 4, 4, 64
  r.tlt.solo_steps = 2
  c.drafter.trainer.rows_per_device, c.drafter.trainer.warmup_steps, c.drafter.trainer.row_len = 1, 1, 64
  c.rl.row_len, c.rl.actor.micro_batch_rows, c.rl.mini_batches, c.rl.optimizer.warmup_steps = 96, 4, 1, 0
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
  c.rollout.engine.batch_buckets = (1, 2, 4, 8, 16, 32, 64, 128)
  c.rollout.sampling.max_new_tokens = 256
  c.rollout.strategies = ("5_2_8",)  # the bandit plays it against SD off per batch-size bucket
  c.rollout.engine.sd_max_batch = 16
  c.rollout.compilation_cache_dir = "runs/xla_cache"  # later runs skip compiling
  # Half the SFT solutions lack their `Answer:` line: the SFT policy answers about half the time, and
  # RL unlearning that habit lifts the held-out reward by several times its noise in 20 steps.
  c.sft.unanswered = 0.5
  c.drafter.distill.steps = 200
  c.rl.row_len = 384
  c.rl.optimizer.learning_rate = 1e-4
  c.rl.optimizer.warmup_steps = 10
  c.rl.mini_batches = 4
  c.eval.every = 10  # held-out reward before the first step, at step 10 and at the end
  c.eval.size = 256  # x 4 samples: a 95% interval of about +-0.02 on the reward's change
  if variant == "smoke":
    smoke(c)
  elif variant:
    raise ValueError(f"the tiny config: unknown variant {variant!r} (known: smoke)")
  c.lock()
  return c


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


# Keys that were renamed or moved into the subtree of the dataclass they build: a config file or a
# --config override that sets one is an error naming the new key.
RENAMED = {
    **{f"rollout.{k}": f"rollout.sampling.{k}" for k in ("temperature", "top_p", "top_k", "max_new_tokens")},
    **{f"rollout.{k}": f"rollout.engine.{k}" for k in ("batch_buckets", "refill", "segment_steps", "kv_block",
                                                        "sd_max_batch", "suffix_bank_len", "suffix_ngram",
                                                        "suffix_history_len")},
    "kernels.attention": "rollout.engine.attention",
    **{f"rollout.bandit_{k}": f"rollout.bandit.{k}" for k in ("thresholds", "epsilon", "window")},
    "drafter.warmup_steps": "drafter.distill.steps",
    "drafter.learning_rate": "drafter.distill.learning_rate",
    "drafter.batch_rows": "drafter.distill.batch_rows",
    "drafter.row_len": "drafter.distill.row_len and drafter.trainer.row_len",
    "drafter.online": "rollout.tlt.enabled",
    **{f"drafter.online_{k}": f"drafter.trainer.{k}" for k in ("learning_rate", "warmup_steps", "rows_per_device")},
    "drafter.solo_steps": "rollout.tlt.solo_steps",
    "drafter.buffer_pairs": "drafter.buffer.max_pairs",
    "rl.normalize_std": "rl.advantage_std",
    **{f"rl.{k}": f"rl.optimizer.{k}" for k in ("learning_rate", "warmup_steps", "weight_decay", "max_grad_norm")},
    **{f"rl.{k}": f"rl.actor.{k}" for k in ("micro_batch_rows", "clip_low", "clip_high", "kl_coef", "remat",
                                            "logits_chunk", "attention_block")},
}


def renamed(key: str) -> str | None:
  """The error for an old key `key` (dotted, below `config.`), or None when it is not one."""
  if key in RENAMED:
    return f"config.{key} is now config.{RENAMED[key].replace(' and ', ' and config.')} (tlt_jax/config.py)"
  return None


# Smallest valid value of each numeric key of the sections no dataclass is built from ('>' where a key
# must be strictly above it); the others are checked by their dataclasses. Every float must be finite.
_AT_LEAST = {
    "steps": 0, "mesh.cpu_devices": 0, "mesh.device_memory_gb": 0, "mesh.dry_run_devices": 1,
    "model.vocab_size": 0, "model.hidden_size": 1, "model.num_layers": 1, "model.num_heads": 1,
    "model.num_kv_heads": 1, "model.head_dim": 1, "model.intermediate_size": 1, "model.max_position_embeddings": 1,
    "task.min_terms": 1, "data.size": 1, "data.max_prompt_len": 1,
    "sft.num_problems": 1, "sft.steps": 0, "sft.batch_rows": 1, "sft.row_len": 2, "sft.learning_rate": 0,
    "sft.warmup_steps": 0, "sft.weight_decay": 0, "sft.unanswered": 0, "sft.eval_size": 0, "sft.eval_max_new_tokens": 1,
    "rollout.prompts_per_step": 1, "rollout.num_samples": 1, "rollout.groups": 1, "rollout.mean_response_len": 0,
    "drafter.draft_vocab_size": -1, "drafter.distill.steps": 0, "drafter.distill.learning_rate": 0,
    "drafter.distill.batch_rows": 1, "drafter.distill.row_len": 2, "drafter.distill.draft_steps": 1,
    "drafter.distill.prompts": 1,
    "rl.mini_batches": 1, "rl.max_skipped_updates": 1, "rl.row_len": 2, "rl.overlong_buffer": 0, "rl.tis_cap": 0,
    "rl.advantage_eps": 0, "data.reward_workers": 0,
    "rl.optimizer.learning_rate": 0, "rl.optimizer.warmup_steps": 0, "rl.optimizer.weight_decay": 0,
    "rl.actor.micro_batch_rows": 1, "rl.actor.logits_chunk": 1, "rl.actor.attention_block": 0,
    "rl.actor.clip_low": 0, "rl.actor.clip_high": 0, "rl.actor.kl_coef": 0,
    "eval.every": 0, "eval.size": 1, "eval.num_samples": 1, "checkpoint.every": 1, "checkpoint.keep": 1,
}
_ABOVE = {"model.rope_theta": 0, "task.tail_alpha": 0, "rl.optimizer.max_grad_norm": 0, "data.reward_timeout_s": 0,
          "drafter.draft_vocab_coverage": 0}
_AT_MOST = {"sft.unanswered": 1, "drafter.draft_vocab_coverage": 1}
_CHOICES = {
    "policy.dtype": ("float32", "bfloat16"),
    "policy.weight_dtype": ("float32", "bfloat16"),
    "policy.export_dtype": ("", "float32", "bfloat16"),
    "task.family": tuple(sorted(tasks.FAMILIES)),
    "rl.loss_aggregation": grpo.AGGREGATIONS,
    "rl.advantage_std": grpo.ADVANTAGE_STDS,
    "rollout.drafter": ("eagle", "suffix"),
}
# Tuple keys and what they hold (a --config override writes a tuple as a Python literal).
_TUPLES = {"rollout.strategies": ("strategy names", str), "rollout.engine.batch_buckets": ("integers", int),
           "rollout.bandit.thresholds": ("integers", int), "drafter.feature_layers": ("integers", int)}


def eval_set(**keys) -> ml_collections.ConfigDict:
  """A named evaluation set (`config.eval.sets.<name>`): these keys, `keys` changed."""
  s = ml_collections.ConfigDict()
  s.path = ""  # a .jsonl / .parquet file or a datasets.save_to_disk directory (the `data.path` formats)
  s.prompt_key, s.answer_key, s.answer_regex, s.system_prompt = "", "", "", ""  # as data.*
  s.reward = "math_verify"  # as data.reward
  s.size = 0  # prompts: the first this many (0: all)
  s.num_samples = 4  # responses per prompt
  s.temperature = -1.0  # -1: the rollout's
  s.k = 0  # pass@k's k (0: num_samples)
  for key, value in keys.items():
    if key not in s:
      raise ValueError(f"eval_set: unknown key {key!r}; its keys: {', '.join(s)}")
    s[key] = value
  return s


def check(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first bad key: an old or unknown key, an unset, ill-typed or out-of-range
  value (the dataclasses built from their subtrees check theirs), or sections that do not fit together."""
  def need(ok: bool, key: str, why: str):
    if not ok:
      raise ValueError(f"config.{key}={config_value(config, key)!r}: {why}")
  known = dict(leaves(base()))
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
  need(config.rl.actor.clip_low < 1, "rl.actor.clip_low", "must be < 1")
  for key, choices in _CHOICES.items():
    need(config_value(config, key) in choices, key, f"must be one of {choices}")
  for key in ("mesh.data", "mesh.fsdp", "mesh.tensor"):
    need(config_value(config, key) == -1 or config_value(config, key) >= 1, key, "must be >= 1, or -1 (the rest)")
  for key in ["data.reward", *(f"eval.sets.{name}.reward" for name in config.eval.sets)]:
    try:
      rewards.check(config_value(config, key))
    except rewards.RewardError as e:
      need(False, key, str(e))
  for prefix in ["data", *(f"eval.sets.{name}" for name in config.eval.sets)]:
    try:
      datasets.Keys(*(config_value(config, f"{prefix}.{k}") for k in ("prompt_key", "answer_key", "answer_regex",
                                                                        "system_prompt")))
    except ValueError as e:
      need(False, f"{prefix}.answer_regex", str(e))
  need(config.policy.weight_dtype != "bfloat16" or config.policy.dtype == "bfloat16", "policy.weight_dtype",
       "bfloat16 master weights need policy.dtype=bfloat16 (weights narrower than the compute)")
  need(config.rl.tis_cap == 0 or config.rl.tis_cap >= 1, "rl.tis_cap", "must be 0 (off) or >= 1")
  need(config.model.num_heads % config.model.num_kv_heads == 0, "model.num_heads",
       "must be a multiple of model.num_kv_heads")
  need(config.task.max_terms >= config.task.min_terms, "task.max_terms", "must be >= task.min_terms")
  try:
    named = strategies(config)
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
      ("rollout.sampling", lambda: sampling_params(config), {}),
      ("rollout.engine", lambda: engine_config(config, named),
       {"max_prompt_len": "data.max_prompt_len", "max_new_tokens": "rollout.sampling.max_new_tokens"}),
      ("rollout.bandit", lambda: bandit(config, named), {}),
      ("rollout.tlt", lambda: tlt_config(config), {}),
      ("drafter.trainer", lambda: drafter_trainer_config(config), {}),
      ("drafter.buffer", lambda: BufferConfig(**config.drafter.buffer), {})):
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
  if (d.enabled or _multi_host_environment()) and not config.dry_run:  # a dry run simulates the devices
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
