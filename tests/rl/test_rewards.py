"""Tests for tlt_jax/rl/rewards.py: the built-ins, loading a user's functions, reading their calling
convention (verl's, verl's batch, TRL's) and calling them as verl and TRL do (TRL's own `_calculate_rewards`
is the reference)."""

import math
import textwrap
import threading
import types

import numpy as np
import pytest

from tlt_jax.rl import rewards
from tlt_jax.rl import tasks


@pytest.fixture(scope="module")
def problem():
  return tasks.generate("chain_sum", 8, seed=0)[-1]


def test_reasoning_gym_reward(problem):
  reward = rewards.load("reasoning_gym")
  extra = {"entry": problem.entry}
  assert reward("chain_sum", problem.solution, problem.answer, extra) == 1.0
  wrong = f"Answer: {int(problem.answer) + 1}"
  for response in (wrong, "%%garbage%%", "", None, problem.answer):  # bare answer: no format
    assert reward("chain_sum", response, problem.answer, extra) < 1.0


@pytest.mark.parametrize(
    "response, ground_truth, correct",
    [
        ("so the result is \\boxed{42}.", "42", True),
        ("so the result is \\boxed{41}.", "42", False),
        ("2+2=4\nAnswer: 4", "4", True),
        ("Answer: 1/2", "\\frac{1}{2}", True),
        ("Answer: 0.5", "$\\frac{1}{2}$", True),
        ("We get $x^2 + 1$, the final answer is \\boxed{1 + x^2}", "x^2+1", True),
        ("The final answer is 7", "\\boxed{7}", True),
        ("Answer: 8", "7", False),
        ("no idea", "7", False),
        ("", "7", False),
        (None, "7", False),
    ],
)
def test_math_verify_reward(response, ground_truth, correct):
  assert rewards.load("math_verify")("openai/gsm8k", response, ground_truth) == float(correct)


def test_math_verify_reward_off_the_main_thread():
  # math-verify's SIGALRM timeout only works on the main thread; we turn it off elsewhere.
  scores = []
  thread = threading.Thread(target=lambda: scores.append(rewards.math_verify_reward(None, "Answer: 3", "3")))
  thread.start()
  thread.join()
  assert scores == [1.0]


@pytest.mark.parametrize(
    "response, score",
    [("1+1=2\nAnswer: 2", 1.0), ("Answer: x", 1.0), ("Answer:", 0.0), ("2", 0.0), (None, 0.0)],
)
def test_format_reward(response, score):
  assert rewards.load("format")(None, response, None) == score


@pytest.mark.parametrize(
    "response, ground_truth, score, formatted",
    [("3 + 4 = 7\n#### 7", "7", 1.0, 1.0), ("#### 1,234", "1234", 1.0, 1.0), ("#### 7.0", "7", 1.0, 1.0),
     ("it is 7", "7", 1.0, 0.0), ("#### 8 and later 7", "7", 0.0, 1.0), ("#### -3", "-3", 1.0, 1.0),
     ("no number", "7", 0.0, 0.0), (None, "7", 0.0, 0.0), ("#### 7", "seven", 0.0, 1.0)],
)
def test_gsm8k_reward(response, ground_truth, score, formatted):
  """The number after the last "####", else the last number (not formatted), equal as numbers."""
  assert rewards.load("gsm8k")("openai/gsm8k", response, ground_truth) == {"score": score, "formatted": formatted}


def test_auto_routes_each_row_by_its_data_source(problem):
  """A dataset mixing sources: reasoning-gym's rows to its scorer, GSM8K's to gsm8k, the rest to math_verify."""
  auto = rewards.load("auto")
  assert auto("chain_sum", problem.solution, problem.answer, {"entry": problem.entry}) == 1.0
  assert auto("openai/gsm8k", "so 12\n#### 12", "12", {}) == {"score": 1.0, "formatted": 1.0}
  assert auto("openai/gsm8k", "so \\boxed{12}", "12", {})["score"] == 1.0  # its last number
  assert auto("lighteval/MATH", "so \\boxed{\\frac{1}{2}}", "0.5", {}) == 1.0  # math_verify: no entry needed


def test_cannot_score_names_what_a_row_lacks(problem):
  """reasoning_gym (and auto on a reasoning-gym source) reads the row's entry: a file without it is refused."""
  item = lambda source, extra: rewards.Item(source, None, "7", extra)
  for spec in ("reasoning_gym", "auto"):
    assert "extra_info.entry" in rewards.cannot_score(rewards.Reward.of(spec), item("chain_sum", {}))
    assert rewards.cannot_score(rewards.Reward.of(spec), item("chain_sum", {"entry": problem.entry})) is None
  assert rewards.cannot_score(rewards.Reward.of("auto"), item("openai/gsm8k", {})) is None
  assert rewards.cannot_score(rewards.Reward.of(("format", "reasoning_gym")), item(None, {})) is not None


def test_unknown_or_unloadable_rewards_say_why(tmp_path):
  with pytest.raises(rewards.RewardError, match="unknown reward 'accuracy': one of .*'path/to/file.py:function'"):
    rewards.load("accuracy")
  with pytest.raises(rewards.RewardError, match="cannot import .*missing.py: FileNotFoundError"):
    rewards.load(f"{tmp_path}/missing.py:compute_score")
  broken = tmp_path / "broken.py"
  broken.write_text("import no_such_module\n")
  with pytest.raises(rewards.RewardError, match="ModuleNotFoundError: No module named 'no_such_module'"):
    rewards.load(f"{broken}:compute_score")
  with pytest.raises(rewards.RewardError, match="has no function 'score'"):
    rewards.load("tlt_jax.rl.rewards:score")




# Reward functions as verl and TRL users write them: parameters reordered, subsets, **kwargs, async, batches.
USER_REWARDS = textwrap.dedent("""
    import asyncio

    def verl_reordered(solution_str, ground_truth, **kwargs):
      return {"score": float(solution_str.strip() == ground_truth), "source": float(kwargs["data_source"] == "mine")}

    def verl_subset(ground_truth, solution_str):
      return float(solution_str.strip() == ground_truth)

    def verl_batch(solution_strs, ground_truths, extra_infos=None, data_sources=None):
      assert all(type(x).__name__ == "ndarray" and x.dtype == object for x in (solution_strs, ground_truths,
                                                                               extra_infos, data_sources))
      return [float(s.strip() == g) * e.get("weight", 1.0)
              for s, g, e in zip(solution_strs, ground_truths, extra_infos)]

    def trl_accuracy(completions, answer, **kwargs):
      texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
      kwargs["log_metric"]("step_seen", kwargs["trainer_state"].global_step)
      kwargs["log_extra"]("answer_seen", list(answer))
      return [None if t == "skip" else float(t.strip() == a) for t, a in zip(texts, answer)]

    async def trl_length(prompts, completions, completion_ids, **kwargs):
      await asyncio.sleep(0)
      return [len(ids) / 10 for ids in completion_ids]

    def untyped(a, b):
      return 1.0

    def needs_a_column(completions, difficulty):
      return [1.0 for _ in completions]

    def typo_prompt(prompt, completions):
      return [1.0 for _ in completions]

    def required_extra(solution_str, ground_truth, threshold):
      return 1.0
    """)


@pytest.fixture(scope="module")
def user_rewards(tmp_path_factory):
  path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
  path.write_text(USER_REWARDS)
  return lambda name: f"{path}:{name}"


@pytest.mark.parametrize("name, convention", [("verl_reordered", "verl"), ("verl_subset", "verl"),
                                              ("verl_batch", "verl_batch"), ("trl_accuracy", "trl"),
                                              ("trl_length", "trl"), ("math_verify", "verl")])
def test_the_convention_is_read_from_the_parameter_names(user_rewards, name, convention):
  spec = name if name in rewards.REWARDS else user_rewards(name)
  assert rewards.signature(spec).convention == convention


def test_a_function_no_convention_can_call_is_refused_at_start_up(user_rewards):
  with pytest.raises(rewards.RewardError, match=r"its parameters \(a, b\) name none of verl's"):
    rewards.check(user_rewards("untyped"))
  with pytest.raises(rewards.RewardError, match="required parameter 'threshold' is none that verl passes"):
    rewards.check(user_rewards("required_extra"))
  rewards.check(user_rewards("needs_a_column"))  # its columns are unknown yet
  with pytest.raises(rewards.RewardError, match=r"required parameter 'difficulty' is neither TRL's .* nor a column of "
                                                r"the prompts passed to it \(answer\)$"):
    rewards.check(user_rewards("needs_a_column"), ["prompt", "answer"])
  rewards.check(user_rewards("needs_a_column"), ["prompt", "difficulty"])
  # `prompt` (a typo of `prompts`): a column TRL never passes, refused at the check, not at the first scoring.
  with pytest.raises(rewards.RewardError, match=r"required parameter 'prompt' is neither .* \(answer\) \(TRL passes "
                                                r"the prompts as 'prompts'\)$"):
    rewards.check(user_rewards("typo_prompt"), ["prompt", "answer"])


def test_reward_specs_and_weights():
  assert rewards.Reward.of("auto") == rewards.Reward(("auto",), (1.0,))
  assert rewards.Reward.of(("format", "auto"), (0.5, 2)) == rewards.Reward(("format", "auto"), (0.5, 2.0))
  for spec, weights, why in [((), (), "must name a reward"), (("auto", ""), (), "must name a reward"),
                             ("auto", (1.0, 2.0), "2 reward weights for 1 reward functions"),
                             ("auto", (math.nan,), "finite numbers")]:
    with pytest.raises(rewards.RewardError, match=why):
      rewards.Reward.of(spec, weights)


ROWS = [{"prompt": [{"role": "user", "content": "2 + 2?"}], "answer": "4", "data_source": "mine",
         "extra_info": {"weight": 0.5}},
        {"prompt": [{"role": "user", "content": "3 + 3?"}], "answer": "6", "data_source": "other",
         "extra_info": {"weight": 1.0}},
        {"prompt": [{"role": "user", "content": "1 + 1?"}], "answer": "2", "data_source": "mine", "extra_info": {}}]
RESPONSES = ["4", "7", "skip"]
RESPONSE_IDS = [[5, 6], [7], [8, 9, 10]]


def _items():
  return [rewards.Item(r["data_source"], text, r["answer"], r["extra_info"], f"train.jsonl:{i + 1}", r["prompt"],
                       ids, r) for i, (r, text, ids) in enumerate(zip(ROWS, RESPONSES, RESPONSE_IDS))]


def test_verl_functions_are_called_as_verl_calls_them(user_rewards):
  """verl's NaiveRewardManager calls compute_score(data_source=, solution_str=, ground_truth=, extra_info=) per
  response, its BatchRewardManager compute_score(data_sources=, solution_strs=, ground_truths=, extra_infos=)."""
  for name in ("verl_reordered", "verl_subset"):
    fn = rewards.load(user_rewards(name))
    verl = [fn(**{k: v for k, v in dict(data_source=r["data_source"], solution_str=text, ground_truth=r["answer"],
                                         extra_info=r["extra_info"]).items()
                  if name == "verl_reordered" or k in ("solution_str", "ground_truth")})
            for r, text in zip(ROWS, RESPONSES)]
    assert rewards.call(user_rewards(name), _items()) == ("ok", verl, {}, {})
  fn = rewards.load(user_rewards("verl_batch"))  # verl's non-tensor batch: NumPy object arrays
  objects = lambda values: np.array(values + [None], dtype=object)[:-1]
  verl = fn(data_sources=objects([r["data_source"] for r in ROWS]), solution_strs=objects(RESPONSES),
            ground_truths=objects([r["answer"] for r in ROWS]), extra_infos=objects([r["extra_info"] for r in ROWS]))
  assert rewards.call(user_rewards("verl_batch"), _items()) == ("ok", verl, {}, {}) and verl == [0.5, 0.0, 0.0]


def test_trl_functions_get_what_trls_grpo_trainer_passes(user_rewards):
  """TRL's own GRPOTrainer._calculate_rewards (on a stand-in trainer) on the same rows, completions and ids:
  the same values per function, None where TRL has NaN, and the metrics the function logged."""
  import asyncio

  import torch
  from trl.trainer.grpo_trainer import GRPOTrainer
  names = ("trl_accuracy", "trl_length")
  fns = [rewards.load(user_rewards(n)) for n in names]
  logged, extras = [], []
  loop = asyncio.new_event_loop()
  threading.Thread(target=loop.run_forever, daemon=True).start()
  trainer = types.SimpleNamespace(
      accelerator=types.SimpleNamespace(device="cpu", is_main_process=True), reward_funcs=fns,
      reward_processing_classes=[None, None], reward_func_names=list(names), args=types.SimpleNamespace(report_to=[]),
      state=types.SimpleNamespace(global_step=3), _log_completion_extra=lambda *extra: extras.append(extra),
      _log_metric=lambda *metric: logged.append(metric), environments=None, async_loop=loop)
  completions = [[{"role": "assistant", "content": text}] for text in RESPONSES]  # chat prompts: chat completions
  try:
    theirs = GRPOTrainer._calculate_rewards.__wrapped__(trainer, ROWS, [r["prompt"] for r in ROWS], completions,
                                                        RESPONSE_IDS)
  finally:
    loop.call_soon_threadsafe(loop.stop)
  state = rewards.TrainerState(global_step=3, max_steps=10)
  ours = [rewards.call(user_rewards(n), _items(), state) for n in names]
  assert [kind for kind, *_ in ours] == ["ok", "ok"]
  got = torch.tensor([[math.nan if v is None else v for v in values] for _, values, *_ in ours]).T
  torch.testing.assert_close(got, theirs, equal_nan=True)
  assert ours[0][2] == {"step_seen": 3.0} and logged == [("step_seen", 3)]
  assert ours[0][3] == {"answer_seen": [r["answer"] for r in ROWS]}  # log_extra's column, as TRL's gets it
  assert extras == [("answer_seen", ours[0][3]["answer_seen"])]


def test_trl_completions_are_strings_for_string_prompts(user_rewards):
  items = [rewards.Item(None, "4", "4", {}, prompt="2 + 2?", columns={"answer": "4"})]
  assert rewards.call(user_rewards("trl_accuracy"), items) == ("ok", [1.0], {"step_seen": 0.0}, {"answer_seen": ["4"]})


def test_a_multi_turn_completion_is_the_whole_conversation(user_rewards):
  """With tools TRL passes every message after the prompt (`tools.conversation`), not the last turn's text."""
  call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 2"}}}
  conversation = [{"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "name": "calculator", "content": "4"}, {"role": "assistant", "content": "4"}]
  items = [rewards.Item(None, "4", "4", {}, prompt="2 + 2?", conversation=conversation)]
  assert rewards._trl_kwargs(items, rewards.TrainerState(), {}, {})["completions"] == [conversation]  # pylint: disable=protected-access


def test_a_call_that_raises_is_an_error_result(user_rewards):
  kind, why, *_ = rewards.call(user_rewards("trl_accuracy"), [rewards.Item(None, "4", "4", {}, prompt="?")])
  assert kind == "error" and why.startswith("TypeError: trl_accuracy() missing 1 required positional argument")
