"""Qwen2.5-32B: GRPO with TLT on 4 hosts x 8 GPUs (multi-host: one process per host).

  # on every host (Slurm: srun sets the process id and count; jax.distributed reads them)
  python -m tlt_jax.main --config=configs/qwen2_5_32b.py --config.policy.path=/data/Qwen2.5-32B \
      --config.drafter.path=/data/qwen2_5_32b_drafter --config.data.path=/data/eurus2_rl/train.parquet
  python -m tlt_jax.main --config=configs/qwen2_5_32b.py --config.dry_run=True   # 32 simulated devices

Trainer: FSDP over all 32 GPUs. Rollout: 8 groups of 4 GPUs (tensor-parallel inside a group).
"""

from tlt_jax.configs import r1_7b  # the installed copy: from any directory


def get_config():
  c = r1_7b.get_config()
  c.workdir = "runs/qwen2_5_32b"
  c.distributed.enabled = True
  c.distributed.num_processes = 4  # one per host (jax.distributed reads it from Slurm; a dry run lays out the hosts)
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 32, 1
  c.mesh.dry_run_devices = 32
  c.policy.path = "/data/Qwen2.5-32B"
  c.drafter.path = "/data/qwen2_5_32b_drafter"
  m = c.model
  m.hidden_size, m.intermediate_size, m.num_layers = 5120, 27648, 64
  m.num_heads, m.num_kv_heads, m.head_dim = 40, 8, 128
  m.rope_theta, m.max_position_embeddings = 1e6, 131072
  c.rollout.groups = 8  # of 4 GPUs: 16 rows fit an H100 with 0.13 GB to spare (docs/BENCHMARKS.md, "Dry runs")
  c.rl.actor.micro_batch_rows = 32  # one row per GPU
  # Attention over 256 queries at a time: at 1024 a GPU's 33k-token row needs 81.2 GB in the gradient step
  # beside the resident state, 8 GB more than at 256 (docs/BENCHMARKS.md, "Dry runs").
  c.rl.actor.attention_block = 256
  return c
