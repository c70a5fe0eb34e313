"""A task of your own, GSM8K-style, to fork: prompt files in verl's or GSM8K's shape, the GSM8K reward (or
yours), the held-out file and two more evaluation sets.

  python -m tlt_jax.main --config=configs/gsm8k_style.py --config.policy.path=/data/Qwen2.5-0.5B-Instruct \
      --config.data.path=/data/gsm8k/train.parquet --config.eval.path=/data/gsm8k/test.parquet
  python -m tlt_jax.main --config=configs/gsm8k_style.py:smoke --config.policy.path=DIR \
      --config.data.path=FILE --config.eval.path=FILE   # seconds-sized shapes, one RL step

The files may be verl's preprocessed GSM8K (`prompt` as chat messages, `reward_model.ground_truth` a bare
number, `data_source`, `extra_info`) or GSM8K's own rows (`question`, `answer` ending "#### 72"): the
default keys find either, and `data.answer_regex` takes the number out of an answer where it matches (a
bare ground truth is taken as it is). The built-in "gsm8k" reward scores a response by the number after
its last "####" (else its last number); your own reward is `--config.data.reward=my_reward.py:fn`, in verl's
convention or TRL's (README, "Your own task"), several summed with `data.reward_weights`.
Files may be JSONL, Parquet or a directory saved by `datasets` (`pip install 'tlt_jax[data]'`): the
training file (`data.path`), the held-out one (`eval.path`, read with the same keys) and each
evaluation set's. The sets here sample the held-out file greedily (pass@1) and at temperature 1 with
8 samples a prompt (pass@8).
"""

from tlt_jax import config as config_lib


def get_config(variant: str = ""):
  c = config_lib.base()
  c.workdir = "runs/gsm8k_style"
  c.policy.path = "/data/Qwen2.5-0.5B-Instruct"
  c.policy.dtype = "bfloat16"
  d = c.data
  d.path = "/data/gsm8k/train.parquet"
  d.answer_regex = "#### (.*)"
  d.system_prompt = "Solve the problem step by step, then end with a line '#### <number>'."
  d.reward = "gsm8k"
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
      k: d.get_ref(k) for k in ("prompt_key", "answer_key", "answer_regex", "system_prompt", "reward",
                                "reward_weights")}, size=256, **more)
  c.eval.sets.greedy = test(num_samples=1, temperature=0.0)
  c.eval.sets.pass8 = test(num_samples=8, temperature=1.0, k=8)
  if variant == "smoke":
    config_lib.smoke(c)
    c.policy.dtype = "float32"
    # The prompts as long as the full config's: verl's end with an instruction ("Let's think step by step
    # and output the final answer after "####".") and come after the system turn.
    c.data.max_prompt_len, c.rollout.sampling.max_new_tokens, c.rl.row_len = 256, 24, 280
    c.drafter.distill.row_len = c.drafter.trainer.row_len = 280  # a prompt and its response, as rl.row_len
    c.rollout.prompts_per_step, c.rollout.num_samples = 2, 4
    c.data.reward_workers = 1
    c.eval.every, c.eval.size = 1, 2
    for s in c.eval.sets.values():
      s.size, s.num_samples, s.k = 2, min(s.num_samples, 2), min(s.k, 2)
  elif variant:
    raise ValueError(f"configs/gsm8k_style.py: unknown variant {variant!r} (known: smoke)")
  return c
