"""Qwen2.5-0.5B-Instruct on one Colab GPU/TPU: a few RL steps with TLT on GSM8K-style data.

  python -m tlt_jax.main --config=configs/qwen2_5_0_5b.py \
      --config.policy.path=/content/Qwen2.5-0.5B-Instruct --config.data.path=/content/gsm8k_train.jsonl \
      --config.drafter.path=/content/qwen_0_5b_drafter
  python -m tlt_jax.train_drafter --model=/content/Qwen2.5-0.5B-Instruct \
      --prompts=/content/drafter_prompts.jsonl --output=/content/qwen_0_5b_drafter --num_samples=4

colab/tlt_qwen2_5_0_5b.ipynb downloads the model and data and runs the same steps (the drafter's
prompts: the first 512 training questions as {"prompt": ...} lines; shorter training there).
`get_config("smoke")` is the same recipe at the tiny world's smoke shapes, for a tiny local policy on
a CPU (the notebook's offline smoke mode).
"""

from tlt_jax import config as config_lib


def get_config(variant: str = ""):
  c = config_lib.base()
  c.workdir = "runs/qwen2_5_0_5b"
  c.steps = 10
  c.mesh.device_memory_gb = 15.0  # a Colab T4 / L4 has 15-22 GB; a v5e TPU core 16 GB
  c.mesh.dry_run_devices = 1
  c.policy.path = "/content/Qwen2.5-0.5B-Instruct"
  c.policy.dtype = "bfloat16"
  m = c.model  # Qwen2.5-0.5B's shape, for a dry run without the checkpoint
  m.architecture, m.vocab_size, m.hidden_size, m.intermediate_size = "Qwen2ForCausalLM", 151936, 896, 4864
  m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim = 24, 14, 2, 64
  m.rope_theta, m.max_position_embeddings, m.tie_word_embeddings = 1e6, 32768, True
  c.data.path = "/content/gsm8k_train.jsonl"
  c.data.reward = "math_verify"
  c.data.max_prompt_len = 256
  r = c.rollout
  r.prompts_per_step, r.num_samples, r.strategies = 16, 8, ("6_4_16", "6_4_8")
  r.sampling.temperature, r.sampling.max_new_tokens = 1.0, 1024
  # 64 rows at once (the 128 rows of a step refill them): on a TPU v5e chip the 128-row decode play needs 17.0 GB
  # of its 16 (XLA keeps copies of the KV cache there), 64 rows fit (docs/BENCHMARKS.md, "Dry runs").
  r.engine.batch_buckets = (1, 2, 4, 8, 16, 32, 64)
  r.engine.kv_block, r.engine.sd_max_batch = 128, 16
  c.drafter.path = "/content/qwen_0_5b_drafter"
  c.rl.optimizer.learning_rate = 1e-6
  c.rl.actor.micro_batch_rows = 2  # 4 needs 15.9 GB in the gradient step beside the AdamW state: over a T4's 15
  c.rl.row_len = 256 + 1024
  c.rl.actor.remat = True
  c.rl.loss.kl_coef = 0.001
  if variant == "smoke":
    config_lib.smoke(c)
    c.policy.dtype = "float32"
    c.rl.actor.remat = False
  elif variant:
    raise ValueError(f"configs/qwen2_5_0_5b.py: unknown variant {variant!r} (known: smoke)")
  c.lock()
  return c
