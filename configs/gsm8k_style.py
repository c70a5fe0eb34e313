"""A task of your own, GSM8K-style, to fork: question / answer files, a reward file in verl's signature,
the held-out file and two more evaluation sets.

  python -m tlt_jax.main --config=configs/gsm8k_style.py --config.policy.path=/data/Qwen2.5-0.5B-Instruct \
      --config.data.path=/data/gsm8k/train.parquet --config.eval.path=/data/gsm8k/test.parquet
  python -m tlt_jax.main --config=configs/gsm8k_style.py:smoke --config.policy.path=DIR \
      --config.data.path=FILE --config.eval.path=FILE   # seconds-sized shapes, one RL step

The rows hold `question` and `answer` ("... #### 72"); `data.answer_regex` takes the number out as the
ground truth, and configs/gsm8k_reward.py scores the responses (the number after their "####").
Files may be JSONL, Parquet or a directory saved by `datasets` (`pip install 'tlt_jax[data]'`): the
training file (`data.path`), the held-out one (`eval.path`, read with the same keys) and each
evaluation set's. The sets here sample the held-out file greedily (pass@1) and at temperature 1 with
8 samples a prompt (pass@8).
"""

import os

from tlt_jax import config as config_lib

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config(variant: str = ""):
  c = config_lib.base()
  c.workdir = "runs/gsm8k_style"
  c.policy.path = "/data/Qwen2.5-0.5B-Instruct"
  c.policy.dtype = "bfloat16"
  d = c.data
  d.path = "/data/gsm8k/train.parquet"
  d.prompt_key, d.answer_key, d.answer_regex = "question", "answer", "#### (.*)"
  d.system_prompt = "Solve the problem step by step, then end with a line '#### <number>'."
  d.reward = os.path.join(HERE, "gsm8k_reward.py") + ":compute_score"
  d.max_prompt_len = 256
  c.rollout.sampling.max_new_tokens = 512
  c.rl.row_len = 256 + 512
  c.rl.optimizer.learning_rate = 1e-6
  c.eval.every = 10
  c.eval.path = "/data/gsm8k/test.parquet"
  c.eval.size = 256
  # The sets read the held-out file with the training data's keys and reward (references: a --config
  # override of eval.path or data.* reaches them too).
  test = lambda **more: config_lib.eval_set(path=c.eval.get_ref("path"), **{
      k: d.get_ref(k) for k in ("prompt_key", "answer_key", "answer_regex", "system_prompt", "reward")}, size=256,
      **more)
  c.eval.sets.greedy = test(num_samples=1, temperature=0.0)
  c.eval.sets.pass8 = test(num_samples=8, temperature=1.0, k=8)
  if variant == "smoke":
    config_lib.smoke(c)
    c.policy.dtype = "float32"
    c.data.max_prompt_len, c.rollout.sampling.max_new_tokens, c.rl.row_len = 96, 24, 120
    c.drafter.distill.row_len = c.drafter.trainer.row_len = 120  # a prompt and its response, as rl.row_len
    c.rollout.prompts_per_step, c.rollout.num_samples = 2, 4
    c.data.reward_workers = 1
    c.eval.every, c.eval.size = 1, 2
    for s in c.eval.sets.values():
      s.size, s.num_samples, s.k = 2, min(s.num_samples, 2), min(s.k, 2)
  elif variant:
    raise ValueError(f"configs/gsm8k_style.py: unknown variant {variant!r} (known: smoke)")
  return c
