"""The tiny world with a calculator: multi-turn RL where the model calls a tool, on a CPU.

  python -m tlt_jax.main --config=configs/tools.py                       # TLT rollouts with tool turns
  python -m tlt_jax.main --config=configs/tools.py --config.rollout.speculative=False   # plain rollouts
  python -m tlt_jax.main --config=configs/tools.py --config.rollout.tools="()" \\
      --config.workdir=runs/no_tools                                     # the same task without the tool
  python -m tlt_jax.main --config=configs/tools.py:smoke                 # seconds-sized shapes, one RL step

The task: reasoning-gym's basic_arithmetic with 2- and 3-digit operands ("Calculate 261 - 120 - 507."),
too large for a 0.8M-parameter policy to add in its head. The prompt shows the tool (`rollout.tools`,
rendered by the chat template); a response may call it in a Hermes block,
`<tool_call>{"name": "calculator", "arguments": {"expression": "261 - 120 - 507"}}</tool_call>`,
end its turn, and read the result in the tool message the rollout appends (`tlt_jax.rl.tools`),
then answer (`Answer: -366`). The reward scores that last turn. The tool turn's tokens take no loss
and no drafter training.

What RL has to learn: half the SFT solutions call the calculator, the other half work the sum out
line by line (`sft.tool_share`), so the SFT policy calls the tool about half the time and is often
wrong when it does not; GRPO learns to call it. Without tools (`--config.rollout.tools="()"`), the
same SFT budget teaches only the line-by-line solutions.
"""

from tlt_jax import config as config_lib


def get_config(variant: str = ""):
  c = config_lib.get_config("smoke" if variant == "smoke" else "")  # the tiny world (tlt_jax/config.py)
  if variant not in ("", "smoke"):
    raise ValueError(f"the tools config: unknown variant {variant!r} (known: smoke)")
  c.workdir = "runs/tools_smoke" if variant == "smoke" else "runs/tools"
  c.rollout.tools = ("calculator",)
  c.rollout.max_turns = 3
  c.rollout.tool_workers = 2
  c.task.min_digits, c.task.max_digits = 2, 3
  c.sft.steps = 800  # copying the expression and the result takes longer to learn than the tiny world's sums
  c.task.max_terms = 6
  c.sft.unanswered = 0.0
  c.sft.tool_share = 0.5
  c.rollout.sampling.max_new_tokens = 192
  c.rl.row_len = 320
  if variant == "smoke":  # a tool trace is ~120 tokens
    c.rollout.sampling.max_new_tokens, c.data.max_prompt_len = 160, 96
    c.sft.row_len, c.rl.row_len = 256, 256
    c.rollout.tool_workers = 0
  return c
