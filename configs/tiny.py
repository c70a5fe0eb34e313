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
`Answer:` line in half of them (`sft.unanswered`), as truncated or unformatted traces do in real
distillation data. The reward reads that line, so the SFT policy copies a habit that costs it
reward, and GRPO unlearns it: the held-out reward rises within the 20 steps. Without the slip
(`--config.sft.unanswered=0`) a 0.8M-parameter policy this briefly trained has no headroom that
RL reaches in minutes on a CPU: none of 15 recipes tried raised its held-out reward (docs/STATUS.md).
"""

from tlt_jax.config import get_config  # noqa: F401  (the default config, in the package)
