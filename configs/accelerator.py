"""A Qwen2.5-0.5B-shaped target built without downloads, for experiments/accelerator.py on one GPU.

  python experiments/accelerator.py --out=runs/accelerator          # this config, on whatever JAX sees
  python experiments/accelerator.py --out=/tmp/accelerator --smoke  # get_config("smoke"), seconds on a CPU

The tiny world's task (procedural arithmetic, long-tailed response lengths) and character tokenizer,
with Qwen2.5-0.5B's architecture and shape (configs/qwen2_5_0_5b.py), its 151936-token vocabulary
kept: the LM head costs what the real one does (0.49B parameters in all), and a reduced draft head
has something to save. The tokenizer uses the first 103 ids; SFT from scratch (a few minutes on an
H100) trains the others' logits down with the rest, so the policy's distributions are peaked like a
real policy's. RL runs plain or TLT rollouts of configs/r1_7b.py's strategies on one rollout group.
"""

from tlt_jax import config as config_lib


def get_config(variant: str = ""):
  c = config_lib.base()
  c.workdir = "runs/accelerator"  # unused: the experiment builds into <out>/init and logs into <out>/rl
  c.mesh.device_memory_gb = 80.0  # one H100
  c.mesh.dry_run_devices = 1
  c.policy.dtype = "bfloat16"  # rollouts and RL; SFT trains in float32
  m = c.model  # Qwen2.5-0.5B's shape
  m.architecture, m.vocab_size, m.hidden_size, m.intermediate_size = "Qwen2ForCausalLM", 151936, 896, 4864
  m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim = 24, 14, 2, 64
  m.rope_theta, m.max_position_embeddings, m.tie_word_embeddings = 1e6, 32768, True
  c.task.max_terms = 24  # the tiny world's long tail
  c.data.max_prompt_len = 128
  s = c.sft  # ~3.3M tokens, about one pass over the problems
  s.num_problems, s.steps, s.batch_rows, s.row_len = 20000, 800, 16, 256
  s.learning_rate, s.warmup_steps, s.weight_decay = 3e-4, 80, 0.1
  s.unanswered = 0.3  # the tiny world's sloppy teacher: rewards differ within groups, so RL updates
  r = c.rollout
  r.groups, r.prompts_per_step, r.num_samples = 1, 16, 8
  r.strategies = ("8_4_48", "8_4_32", "8_4_16", "8_4_8")  # configs/r1_7b.py's arms
  r.sampling.temperature, r.sampling.max_new_tokens = 1.0, 256
  r.engine.batch_buckets, r.engine.kv_block, r.engine.sd_max_batch = (1, 2, 4, 8, 16, 32, 64, 128), 64, 32
  r.bandit.thresholds = (1, 2, 5, 21)
  d = c.drafter
  d.draft_vocab_size = 32768  # EAGLE-3's reduced head: ~1/5 of the vocabulary
  d.distill.steps, d.distill.batch_rows, d.distill.row_len, d.distill.learning_rate = 400, 16, 384, 3e-3
  c.rl.row_len = 128 + 256
  c.rl.optimizer.learning_rate = 1e-6
  c.rl.actor.micro_batch_rows = 8  # the dry run's gradient: 23 GB of XLA:CPU temporaries (38 GB at 16 rows)
  if variant == "smoke":
    config_lib.smoke(c)
    c.model.num_heads, c.model.num_kv_heads, c.model.head_dim = 2, 1, 16
    c.model.vocab_size = 128  # padded past the tokenizer's 103, as the full size is
    c.drafter.draft_vocab_size = 64
    c.sft.num_problems, c.sft.steps, c.drafter.distill.steps = 64, 4, 2
    # policy.dtype stays bfloat16: the smoke takes the full size's path (SFT in float32, the rest in bfloat16).
  elif variant:
    raise ValueError(f"configs/accelerator.py: unknown variant {variant!r} (known: smoke)")
  c.lock()
  return c
