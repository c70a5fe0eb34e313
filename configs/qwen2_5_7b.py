"""Qwen2.5-7B: GRPO with TLT on one 8-GPU host (the paper's reference run: 64 prompts x 8
responses, max response 32k, temperature 0.9, low-variance KL 0.001, lr 1e-6, Eurus-2-RL data).

  python -m tlt_jax.main --config=configs/qwen2_5_7b.py --config.policy.path=/data/Qwen2.5-7B \
      --config.drafter.path=/data/qwen2_5_7b_drafter --config.data.path=/data/eurus2_rl/train.parquet
  python -m tlt_jax.main --config=configs/qwen2_5_7b.py --config.dry_run=True

Same shape and settings as configs/r1_7b.py except the checkpoint (RoPE base 1e6).
"""

from tlt_jax.configs import r1_7b  # the installed copy: from any directory


def get_config():
  c = r1_7b.get_config()
  c.workdir = "runs/qwen2_5_7b"
  c.policy.path = "/data/Qwen2.5-7B"
  c.drafter.path = "/data/qwen2_5_7b_drafter"
  c.model.rope_theta = 1e6
  c.model.max_position_embeddings = 131072
  return c
