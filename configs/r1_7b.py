"""DeepSeek-R1-Distill-Qwen-7B: GRPO with TLT rollouts on one 8-GPU host (the paper's setting).

  python -m tlt_jax.main --config=configs/r1_7b.py \
      --config.policy.path=/data/DeepSeek-R1-Distill-Qwen-7B \
      --config.drafter.path=/data/r1_7b_drafter --config.data.path=/data/eurus2_rl/train.parquet
  python -m tlt_jax.main --config=configs/r1_7b.py --config.dry_run=True   # size it anywhere, no weights

The policy is a local Hugging Face directory; the drafter a checkpoint from
`python -m tlt_jax.train_drafter --model=DIR --prompts=FILE.jsonl --output=DIR --temperature=1`
(the warm-up, on the policy's own samples at the rollout's temperature); prompts a local Eurus-2-RL /
DAPO-style JSONL or Parquet file. config.model below is only used by a dry run when the policy
directory is absent (it is the checkpoint's config.json shape).
"""

from tlt_jax import config as config_lib


def get_config():
  c = config_lib.base()
  c.workdir = "runs/r1_7b"
  c.steps = 200
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 8, 1  # trainer: FSDP over the 8 GPUs
  c.mesh.device_memory_gb = 80.0  # H100 / A100-80GB
  c.mesh.dry_run_devices = 8

  c.policy.path = "/data/DeepSeek-R1-Distill-Qwen-7B"
  c.policy.dtype = "bfloat16"
  c.model.architecture = "Qwen2ForCausalLM"
  c.model.vocab_size = 152064
  c.model.hidden_size = 3584
  c.model.intermediate_size = 18944
  c.model.num_layers = 28
  c.model.num_heads = 28
  c.model.num_kv_heads = 4
  c.model.head_dim = 128
  c.model.max_position_embeddings = 131072
  c.model.rope_theta = 10000.0
  c.model.tie_word_embeddings = False

  c.data.path = "/data/eurus2_rl/train.parquet"
  c.data.reward = "math_verify"
  c.data.max_prompt_len = 1024

  r = c.rollout
  r.prompts_per_step = 64  # x 8 responses = 512 rollouts per step (the paper's batch)
  r.num_samples = 8
  r.groups = 8  # one rollout group per GPU; finished groups train the drafter
  r.strategies = ("8_4_48", "8_4_32", "8_4_16", "8_4_8")  # TLT's arms: depth 8, top-k 4, verify 48/32/16/8
  r.sampling.temperature = 0.9
  r.sampling.max_new_tokens = 32768
  r.mean_response_len = 8192  # an assumption for sizing a paged cache (the dry run's cache_rows); set yours
  r.engine.batch_buckets = (1, 2, 4, 8, 16)  # rows per group at once: each row's 33k-token KV cache takes 1.9 GB
  # On a TPU (v5p) the 16-row decode does not fit: XLA:TPU copies the cache inside a decode segment (up to 8
  # rows fit there; docs/BENCHMARKS.md, "Dry runs").
  r.engine.segment_steps = 32
  r.engine.kv_block = 512
  r.engine.sd_max_batch = 32
  r.bandit.thresholds = (1, 2, 5, 21)

  c.drafter.path = "/data/r1_7b_drafter"
  c.drafter.distill.steps = 0  # the drafter comes from train_drafter

  rl = c.rl
  rl.optimizer.learning_rate = 1e-6
  rl.mini_batches = 4
  rl.actor.micro_batch_rows = 8  # one 33k-token row per GPU per micro-batch
  rl.row_len = 1024 + 32768
  rl.actor.remat = True
  rl.actor.logits_chunk = 1024
  rl.actor.attention_block = 1024
  rl.loss.kl_coef = 0.001  # low-variance KL to the initial policy
  rl.loss.aggregation = "token"
  c.checkpoint.every = 10
  c.lock()
  return c
