"""Every key `python -m tlt_jax.main` understands, with defaults; experiment configs start from `base()`.

This file is also the CLIs' default config file: its `get_config()` is the tiny world (configs/tiny.py),
found inside the installed package. It is a leaf: it imports nothing from the package.

A config file is `get_config()` returning `base()` with its values set. The returned ConfigDict is
locked, so a mistyped key in a `--config.key=value` override is an error that names the key, and
`tlt_jax.rl.checks.check` rejects keys base() does not have (an old key: naming its new name,
`RENAMED`) and values that would fail later (naming the key).

A subtree that builds a dataclass mirrors it: `SamplingParams(**rollout.sampling, ...)`,
`EngineConfig(**rollout.engine, ...)`, `Bandit(strategies, **rollout.bandit)`, `TLTConfig(**rollout.tlt)`,
`DrafterTrainerConfig(**drafter.trainer, ...)`, `BufferConfig(**drafter.buffer)`,
`actor.make_optimizer(**rl.optimizer)` (its `max_grad_norm` the actor's), `actor.Actor(policy, optimizer,
**rl.actor)` (tlt_jax.rl.builders builds them); the dataclasses check their own fields' ranges (the check
re-raises their errors naming the key). Tuples are tuples; on the command line they are Python literals, strings quoted:
`--config.rollout.strategies="('3_1_4','4_2_6')"`, `--config.rollout.engine.batch_buckets="(1,2,4,8)"`,
`--config.drafter.feature_layers="(1,3,5)"`.
"""

from __future__ import annotations

import re

import ml_collections


def base() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = "runs/tiny"  # checkpoints, metrics, responses, exports (TRL output_dir; verl trainer.default_local_dir)
  c.seed = 0  # sampling, data order and initialisation
  c.steps = 20  # RL steps (TRL max_steps; verl trainer.total_training_steps)
  c.dry_run = False  # compile and size everything for the mesh, read no weights, run nothing

  c.mesh = ml_collections.ConfigDict()
  c.mesh.cpu_devices = 0  # > 0: simulate this many CPU devices (tests, laptops); 0: the real devices
  c.mesh.data = -1  # trainer mesh axes (sharding.MESH_AXES); one may be -1 (the rest)
  c.mesh.fsdp = 1  # parameters and optimizer state sharded over this many devices
  c.mesh.tensor = 1  # tensor parallelism (heads and MLP columns split over this many devices)
  # The hardware a dry run compiles for, deviceless, with its own compiler (tlt_jax/targets: h100, h200,
  # a100-80gb, l4, tpu-v5e, tpu-v5p, tpu-v6e; `pip install 'tlt_jax[gpu]'` or '[tpu]'); "": simulated CPU devices.
  c.mesh.target = ""
  c.mesh.dry_run_devices = 8  # the devices a dry run compiles for (the target's, over distributed.num_processes hosts)
  # The memory a device gives the run: a dry run fails where an executable needs more. 0: the target's (no
  # check on the CPU stand-in); with a target, at most the target's.
  c.mesh.device_memory_gb = 0.0

  c.distributed = ml_collections.ConfigDict()
  c.distributed.enabled = False  # jax.distributed.initialize(); also when the environment says multi-host
  c.distributed.coordinator_address = ""  # "" = from the environment (Slurm, Kubernetes, Cloud TPU)
  c.distributed.num_processes = 0  # hosts (0: from the environment)
  c.distributed.process_id = -1  # this host's index (-1: from the environment)

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
  # LoRA (tlt_jax.models.lora): adapters trained on the frozen base model (in policy.dtype; the adapters and
  # their AdamW moments in policy.weight_dtype); rollouts and exports read the merged weights W + alpha/r B A.
  c.policy.lora = ml_collections.ConfigDict()
  c.policy.lora.rank = 0  # 0: off (full fine-tuning); TRL peft_config.r; verl actor_rollout_ref.model.lora_rank
  c.policy.lora.alpha = 32.0  # scale alpha / rank (TRL's GRPO LoRA recipe: rank 1, alpha 32, lr 10x full)
  # PEFT's target_modules: "all-linear" (q/k/v/o, gate/up/down), a tuple of module names, or a regex matched
  # against the Hugging Face module names (model.layers.3.self_attn.q_proj).
  c.policy.lora.target_modules = _any("all-linear")
  c.policy.lora.path = ""  # a PEFT adapter directory to start from (its rank, alpha and targets)

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
  c.task.min_digits = 1  # digits per operand (reasoning-gym draws the count per problem)
  c.task.max_digits = 1
  c.data = ml_collections.ConfigDict()
  c.data.path = ""  # "" = procedural tasks (task.*); a .jsonl / .parquet file or a datasets.save_to_disk directory
  c.data.size = 4096  # procedural prompts
  c.data.max_prompt_len = 128  # tokens of a templated prompt; longer ones are skipped (verl data.max_prompt_length)
  # Where a file's rows hold what a prompt needs (tlt_jax.rl.datasets.Keys): "" = the usual names
  # (prompt / question / problem; reward_model.ground_truth, ground_truth / answer / solution).
  c.data.prompt_key = ""
  c.data.answer_key = ""  # a dotted path into the row, e.g. "reward_model.ground_truth"
  c.data.answer_regex = ""  # its first group is the ground truth, e.g. "#### (.*)" for GSM8K's answers
  c.data.system_prompt = ""  # a system turn before every prompt that has none
  # What scores a response (tlt_jax.rl.rewards): a built-in (auto: each row by its data_source; reasoning_gym,
  # math_verify, gsm8k, format), or a function of yours, "path/to/file.py:function" or "package.module:function",
  # in verl's convention (compute_score(data_source, solution_str, ground_truth, extra_info), or its batch one)
  # or TRL's (reward(completions, **kwargs) -> list); a tuple of them is summed with `reward_weights`.
  c.data.reward = _any("auto")
  c.data.reward_weights = ()  # one per function of data.reward (() = 1 each; TRL reward_weights)
  c.data.reward_workers = 4  # worker processes scoring rewards (0: in the trainer's process, no timeout)
  c.data.reward_timeout_s = 60.0  # a call that takes longer scores 0 and is counted
  # More failed (raised or timed out) reward calls than this share of a step's or an evaluation's, or all of
  # them, stop the run with an error naming the reward and the first exception.
  c.data.reward_max_failures = 0.1

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
  # With rollout.tools: the fraction of SFT solutions that call the calculator for the answer (the others
  # work it out line by line, as without tools).
  c.sft.tool_share = 1.0

  c.rollout = ml_collections.ConfigDict()
  c.rollout.speculative = True  # False: the plain-rollout baseline, everything else equal
  c.rollout.prompts_per_step = 16  # prompts a step samples (verl data.train_batch_size)
  c.rollout.num_samples = 8  # responses per prompt (the GRPO group; TRL num_generations, verl rollout.n)
  c.rollout.groups = 1  # data-parallel rollout groups (each its devices' share of the prompts)
  # Draft strategies depth_topk_verify (bandit arms beside SD off). With drafter "eagle" (the EAGLE
  # drafter, warmed up, trained online), 's'-strategies (e.g. "s4_1_5") are suffix arms beside its
  # own; with "suffix" (no drafter model) the strategies' shapes draft suffix matches in each
  # prompt's token bank (its prompt and its samples' tokens): no forward pass per draft.
  c.rollout.strategies = ("3_1_4", "4_2_6")
  c.rollout.drafter = "eagle"
  c.rollout.mean_response_len = 0  # what the dry run sizes a paged KV cache for (0: max_new_tokens / 4)
  c.rollout.compilation_cache_dir = ""  # persistent XLA cache, set at start-up: later runs skip compiling
  # Multi-turn rollouts with tools (tlt_jax.rl.tools): functions the model may call in Hermes <tool_call>
  # blocks, "calculator" (built in), "path/to/file.py:function" or "package.module:function"; () = one turn.
  c.rollout.tools = ()
  c.rollout.max_turns = 4  # assistant turns per trajectory at most (the response budget bounds its tokens)
  c.rollout.tool_timeout_s = 10.0  # a call that takes longer is an error message to the model
  c.rollout.tool_workers = 4  # worker processes running the calls (0: threads of the trainer's, timed out unkilled)
  c.rollout.tool_max_tokens = 256  # a longer result keeps its first and last 128 tokens (verl's default length)
  c.rollout.sampling = ml_collections.ConfigDict()  # SamplingParams (stop tokens: the tokenizer's EOS)
  c.rollout.sampling.temperature = 1.0  # TRL temperature; verl rollout.temperature
  c.rollout.sampling.top_p = 1.0  # TRL top_p; verl rollout.top_p
  c.rollout.sampling.top_k = 0  # 0: off (TRL top_k; verl rollout.top_k, -1 there)
  c.rollout.sampling.max_new_tokens = 384  # TRL max_completion_length; verl data.max_response_length
  c.rollout.engine = ml_collections.ConfigDict()  # EngineConfig of each rollout group
  c.rollout.engine.batch_buckets = (1, 2, 4, 8, 16, 32, 64, 128)  # rows at once: 1, 2, 4, ... up to the largest
  c.rollout.engine.refill = True  # more rows than the largest bucket: refill finished rows' slots (False: waves)
  c.rollout.engine.segment_steps = 16  # decode steps between host checks (finished rows, refill, the bandit)
  c.rollout.engine.kv_block = 64  # attention block; a cache's capacity is a multiple of it
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
  c.rollout.bandit.epsilon = 0.1  # the share of plays that explore a random arm
  c.rollout.bandit.window = 300  # each arm's reward: over its last this-many plays in a bucket
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
  # Training-time test: draft steps trained on the drafter's own features (0: 2 at a sampling rollout, else 1).
  c.drafter.distill.draft_steps = 0
  c.drafter.distill.prompts = 256  # a pretrained policy's warm-up: its responses to this many training prompts
  c.drafter.trainer = ml_collections.ConfigDict()  # DrafterTrainerConfig: online training on idle rollout groups
  c.drafter.trainer.learning_rate = 1e-3
  c.drafter.trainer.warmup_steps = 20  # learning-rate warm-up
  c.drafter.trainer.rows_per_device = 2
  c.drafter.trainer.row_len = 256  # packed row length
  c.drafter.trainer.draft_steps = 0  # training-time test steps of each online update (0: the same rule)
  c.drafter.buffer = ml_collections.ConfigDict()  # BufferConfig of the online data
  c.drafter.buffer.max_pairs = 1 << 18

  c.rl = ml_collections.ConfigDict()
  c.rl.mini_batches = 2  # optimizer updates per step, later ones off-policy (verl train_batch / ppo_mini_batch_size)
  c.rl.row_len = 512  # packed row length; must hold the longest prompt + response
  # Group advantages (r - mean) / (std + eps): the sample std as verl and TRL take it, the population
  # std, or none (Dr. GRPO). TRL's eps is 1e-4, verl's 1e-6.
  c.rl.advantage_std = "sample"
  c.rl.advantage_eps = 1e-6
  # Several reward functions (data.reward): sum_then_normalize (their weighted sum's group advantages), or
  # normalize_then_sum (GDPO: each function's group-normalised values summed, then normalised over the
  # batch; advantage_std unused). TRL multi_objective_aggregation.
  c.rl.reward_aggregation = "sum_then_normalize"
  c.rl.dynamic_sampling = True  # drop groups whose rewards are all equal (verl algorithm.filter_groups.enable)
  c.rl.overlong_filter = False  # truncated responses do not enter the loss (TRL mask_truncated_completions)
  c.rl.overlong_buffer = 0  # DAPO's soft overlong penalty over the last this-many tokens (verl overlong_buffer.len)
  # Updates with a non-finite loss or gradient are skipped; this many in a row stop the run (diverged).
  c.rl.max_skipped_updates = 3
  # Rollout correction (tlt_jax.rl.corrections; docs/KEYS.md): importance weights p_trainer / p_rollout of the
  # rollout's own log-probs per token or sequence, truncated to or masked outside [is_min, is_max], and verl's
  # rejection filters (rs: token_k1..k3, seq_sum_*, seq_mean_*, seq_max_k2/k3); `preset`: a verl preset by name
  # (decoupled_token_is, decoupled_seq_is, decoupled_token_icepop, decoupled_geo_rs, ...), which sets the keys
  # left at their defaults here. Logged: verl's mismatch metrics (mismatch/*) whenever the trainer recomputes.
  c.rl.rollout_correction = ml_collections.ConfigDict()
  c.rl.rollout_correction.preset = ""
  c.rl.rollout_correction.is_level = ""  # "" off, token, sequence (verl rollout_is)
  c.rl.rollout_correction.is_mode = "truncate"  # truncate (TIS) or mask (IcePop; TRL's *_mask modes)
  c.rl.rollout_correction.is_min = 0.0  # TRL vllm_importance_sampling_clip_min
  c.rl.rollout_correction.is_max = 2.0  # verl rollout_is_threshold; TRL vllm_importance_sampling_clip_max (3.0)
  c.rl.rollout_correction.is_batch_normalize = False  # weights divided by their batch mean (verl's)
  c.rl.rollout_correction.rs = ""  # verl rollout_rs: rejection options, comma separated
  c.rl.rollout_correction.rs_threshold = ""  # verl rollout_rs_threshold: "lo_hi" for k1 options, else an upper bound
  # The ratio's old log-probs: "rollout" (the rollout's own: no forward pass), "recompute" (the trainer's
  # forward pass over the responses before the first update; logs the mismatch/* gap to the rollout's), or
  # "auto": the rollout's where they are the trainer's numbers up to float32 rounding (policy.dtype float32,
  # no top-k / top-p), else recomputed (bfloat16 compute, whose rollout rounds differently).
  c.rl.old_logp = "auto"
  # The policy loss (grpo.Objective; docs/KEYS.md maps TRL's loss_type and verl's loss_mode to these keys).
  c.rl.loss = ml_collections.ConfigDict()
  c.rl.loss.kind = "clip"  # clip (PPO: GRPO, DAPO, GSPO), cispo, sapo, vespo
  c.rl.loss.aggregation = "token"  # token (DAPO), sequence (GRPO), constant (Dr. GRPO), sequence_sum (TRL luspo)
  c.rl.loss.importance_level = "token"  # token, or sequence (GSPO: a ratio per sequence; TRL importance_sampling_level)
  c.rl.loss.clip_low = 0.2  # TRL epsilon; verl actor.clip_ratio_low
  c.rl.loss.clip_high = 0.28  # DAPO clip-higher (TRL epsilon_high; verl actor.clip_ratio_high)
  c.rl.loss.dual_clip = 0.0  # > 0: the ratio's cap where the advantage is negative (TRL delta; verl clip_ratio_c)
  c.rl.loss.cispo_max = 5.0  # cispo: the importance weight's cap (TRL's epsilon_high under cispo)
  c.rl.loss.sapo_temperatures = (1.0, 1.05)  # sapo: (positive, negative advantages) (TRL sapo_temperature_pos/neg)
  c.rl.loss.vespo = (2.0, 3.0, 3.0, 2.0)  # vespo: (k+, lambda+, k-, lambda-) (TRL vespo_k_pos, ...)
  c.rl.loss.off_policy_mask = 0.0  # > 0: DeepSeek-V3.2's off-policy sequence mask (TRL off_policy_mask_threshold)
  c.rl.loss.top_entropy_quantile = 1.0  # < 1: only the highest-entropy share of tokens trains (TRL's; 0.2 in the paper)
  c.rl.loss.kl_coef = 0.0  # > 0: low-variance KL to the frozen initial policy (TRL beta; verl actor.kl_loss_coef)
  c.rl.loss.kl_is_correction = False  # the KL weighed by the ratio (TRL use_bias_correction_kl)
  c.rl.optimizer = ml_collections.ConfigDict()  # actor.make_optimizer: AdamW after the actor's global-norm clip
  c.rl.optimizer.learning_rate = 1e-4  # TRL learning_rate; verl actor.optim.lr
  c.rl.optimizer.warmup_steps = 0  # learning-rate warm-up
  c.rl.optimizer.weight_decay = 0.0  # AdamW's (TRL weight_decay; verl actor.optim.weight_decay)
  c.rl.optimizer.max_grad_norm = 1.0  # TRL max_grad_norm; verl actor.grad_clip
  c.rl.actor = ml_collections.ConfigDict()  # actor.Actor
  c.rl.actor.micro_batch_rows = 8  # packed rows per forward/backward (verl ppo_micro_batch_size_per_gpu)
  c.rl.actor.remat = False  # recompute each layer in the backward pass (long rows)
  c.rl.actor.logits_chunk = 1024  # LM-head positions at a time in the loss (bounds the [T, vocab] logits)
  c.rl.actor.attention_block = 0  # > 0: attention over this many queries at a time (bounds [T, T] scores)

  # Held-out evaluation: the same prompts and sampling keys every time, so evaluations compare.
  c.eval = ml_collections.ConfigDict()
  c.eval.every = 0  # > 0: before the first step, every this many steps and after the last (0: off; verl test_freq)
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
  # Each step's first responses (whole groups first), as text with their prompt, reward and advantage:
  # <workdir>/completions.jsonl, a TensorBoard text table, and a W&B table with logging.wandb (0: none).
  # TRL: log_completions, num_completions_to_print; verl: trainer.log_val_generations (held-out ones).
  c.logging.completions_per_step = 8

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 5  # steps (TRL save_steps; verl trainer.save_freq)
  c.checkpoint.keep = 2  # the newest this many checkpoints are kept
  return c


def _any(value) -> ml_collections.FieldReference:
  """A key that takes a string or a tuple (`--config.data.reward="('a.py:f', 'b.py:g')"`)."""
  return ml_collections.FieldReference(value, field_type=object)


def smoke(c: ml_collections.ConfigDict) -> None:
  """Seconds-sized shapes (`get_config("smoke")` of a config file): a 2-layer tiny policy, short prompts
  and responses, one RL step on one device (one rollout group). For notebook smoke runs and tests."""
  c.steps = 1
  c.workdir = c.workdir.rstrip("/") + "_smoke"  # its policy is not the full config's
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
  # The update runs (a smoke policy's two samples rarely differ in reward), its lengths a signal.
  c.rl.dynamic_sampling, c.rl.overlong_buffer = False, r.sampling.max_new_tokens
  c.eval.every = 0


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """The tiny world, the default `--config` (this file; configs/tiny.py says more): a 0.8M-parameter
  Qwen3-architecture policy on procedural arithmetic, RL with TLT on a CPU in minutes.

  `variant="smoke"`: the same pipeline at seconds-sized shapes (notebook smoke runs, tests).
  """
  c = base()
  c.workdir = "runs/tiny"  # checkpoints, metrics, responses, exports (TRL output_dir; verl trainer.default_local_dir)
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
  # One draft step of training-time test, warm-up and online: the tiny world's figures were measured so
  # (its warm-up reads SFT solutions, not the policy's samples).
  c.drafter.distill.draft_steps = c.drafter.trainer.draft_steps = 1
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
    **{f"rl.{k}": f"rl.actor.{k}" for k in ("micro_batch_rows", "remat", "logits_chunk", "attention_block")},
    **{f"{p}.{k}": f"rl.loss.{k}" for k in ("clip_low", "clip_high", "kl_coef") for p in ("rl", "rl.actor")},
    "rl.loss_aggregation": "rl.loss.aggregation",
    "rl.tis_cap": "rl.rollout_correction.is_level and rl.rollout_correction.is_max",
}


def renamed(key: str) -> str | None:
  """The error for an old key `key` (dotted, below `config.`), or None when it is not one."""
  if key in RENAMED:
    return f"config.{key} is now config.{RENAMED[key].replace(' and ', ' and config.')} (tlt_jax/config.py)"
  return None


def comments() -> dict[str, str]:
  """Each key's comment in this file: its line's, else the comment block above it. A block above a subtree
  covers the subtree's uncommented keys (to a blank line); a block above a key covers it and the uncommented
  keys after it, up to a commented key or a subtree. An evaluation set's keys as `eval.sets.*.<key>`."""
  found, block, where, scope = {}, [], "", ""  # scope: "" just after a block, then "subtree" or "keys"
  with open(__file__, encoding="utf-8") as f:
    for line in f:
      text = line.strip()
      if line.startswith("def "):
        where = line[4:].split("(")[0]
      if where not in ("base", "eval_set"):  # the defaults' own lines
        continue
      if text.startswith("#"):  # a block's comment
        block = (block if scope == "" else []) + [text.lstrip("# ")]
        scope = ""
        continue
      match = re.match(r"((?:[cs]\.[\w.]+,\s*)*[cs]\.[\w.]+)\s*=[^#]*(?:#\s*(.*))?$", text)
      subtree = "ConfigDict()" in text
      if not text or (scope == "keys" and (subtree or (match and match.group(2)))):
        block = []
      scope = scope or ("subtree" if subtree else "keys")
      if match:
        comment = match.group(2) or " ".join(block)
        for target in re.split(r",\s*", match.group(1)):
          key = target[2:] if target.startswith("c.") else "eval.sets.*." + target[2:]
          if comment:
            found.setdefault(key, comment)
  return found


def describe(config) -> str:
  """Every key of `config` with its value, its default where that differs, and its comment (`comments`)."""
  notes, defaults = comments(), dict(leaves(base()))
  lines = []
  for key, value in leaves(config):
    note = notes.get(key) or notes.get(re.sub(r"^eval\.sets\.[^.]+\.", "eval.sets.*.", key), "")
    line = f"{key} = {value!r}"
    if key in defaults and defaults[key] != value:
      line += f"  (default {defaults[key]!r})"
    lines.append(line + (f"  # {note}" if note else ""))
  return "\n".join(lines)


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


def eval_set(**keys) -> ml_collections.ConfigDict:
  """A named evaluation set (`config.eval.sets.<name>`): these keys, `keys` changed."""
  s = ml_collections.ConfigDict()
  s.path = ""  # a .jsonl / .parquet file or a datasets.save_to_disk directory (the `data.path` formats)
  s.prompt_key, s.answer_key, s.answer_regex, s.system_prompt = "", "", "", ""  # as data.*
  s.reward = _any("auto")  # as data.reward
  s.reward_weights = ()
  s.size = 0  # prompts: the first this many (0: all)
  s.num_samples = 4  # responses per prompt
  s.temperature = -1.0  # -1: the rollout's
  s.k = 0  # pass@k's k (0: num_samples)
  for key, value in keys.items():
    if key not in s:
      raise ValueError(f"eval_set: unknown key {key!r}; its keys: {', '.join(s)}")
    s[key] = value
  return s
