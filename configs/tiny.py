"""The tiny world: a small Qwen3-architecture policy on procedural arithmetic, RL with TLT on a CPU.

  python -m tlt_jax.main                                   # this config is the default
  python -m tlt_jax.main --config=configs/tiny.py --config.rollout.speculative=False   # baseline
  python -m tlt_jax.sft --config=configs/tiny.py           # only the SFT warm start
  python -m tlt_jax.main --config=configs/tiny.py:smoke    # seconds-sized shapes, one RL step

Runs on a 2-core CPU in minutes with no downloads: SFT warm start of a 0.8M-parameter policy
(unless <workdir>/policy exists), drafter warm-up (unless <workdir>/drafter exists), then GRPO/DAPO
with TLT rollouts. Response lengths are long-tailed (heavy-tailed number of terms), like real
reasoning RL.

What RL has to learn here: the SFT solutions come from a sloppy teacher that leaves off the final
`Answer:` line in 30% of them (`sft.unanswered`), as truncated or unformatted traces do in real
distillation data. The reward reads that line, so the SFT policy copies a habit that costs it
reward, and GRPO unlearns it: the held-out reward rises within the 20 steps. Without the slip
(`--config.sft.unanswered=0`) a 0.8M-parameter policy this briefly trained has no headroom that
RL reaches in minutes on a CPU (docs/BENCHMARKS.md, "Recipe sweep").
"""

from tlt_jax import config as config_lib


def get_config(variant: str = ""):
  """`variant="smoke"`: the same pipeline at seconds-sized shapes (notebook smoke runs, tests)."""
  c = config_lib.base()
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
  c.sft.unanswered = 0.3
  c.drafter.distill.steps = 200
  c.rl.row_len = 384
  c.rl.optimizer.learning_rate = 1e-4
  c.rl.optimizer.warmup_steps = 10
  c.rl.mini_batches = 4
  c.eval.every = 10  # held-out reward before the first step, at step 10 and at the end
  c.eval.size = 64
  if variant == "smoke":
    config_lib.smoke(c)
  elif variant:
    raise ValueError(f"configs/tiny.py: unknown variant {variant!r} (known: smoke)")
  c.lock()
  return c
