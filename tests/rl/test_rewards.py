"""Tests for tlt_jax/rl/rewards.py: the built-ins, rewards of the user's (verl's signature, by file or
module), and the scorer's pool: failures, timeouts and bad scores."""

import logging
import os
import subprocess
import sys
import textwrap
import threading

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


def test_auto_routes_each_row_by_its_data_source(problem):
  """A dataset mixing sources: reasoning-gym's rows to its scorer, the rest to math_verify."""
  auto = rewards.load("auto")
  assert auto("chain_sum", problem.solution, problem.answer, {"entry": problem.entry}) == 1.0
  assert auto("openai/gsm8k", "so \\boxed{12}", "12", {}) == 1.0  # math_verify: no entry needed


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


# A verl user's reward file, unchanged: it reads the data source and the extra info, returns a dict with more
# to log, raises on one sample, hangs on another.
USER_REWARD = textwrap.dedent("""
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
      if solution_str == "boom":
        raise RuntimeError("scorer exploded")
      if solution_str == "hang":
        time.sleep(60)
      if solution_str == "nan":
        return float("nan")
      if solution_str == "no score":
        return {"acc": 1.0}
      right = solution_str.strip() == ground_truth
      return {"score": float(right) * extra_info.get("weight", 1.0), "acc": float(right), "len": len(solution_str),
              "source_is_mine": float(data_source == "mine")}
    """)


@pytest.fixture(scope="module")
def user_reward(tmp_path_factory):
  path = tmp_path_factory.mktemp("reward") / "my_reward.py"
  path.write_text(USER_REWARD)
  return f"{path}:compute_score"


def _items(responses, truth="4"):
  return [rewards.Item("mine", r, truth, {"weight": 0.5}, f"train.jsonl:{i + 1}") for i, r in enumerate(responses)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_users_reward_file_scores_and_logs_its_extra_keys(user_reward, workers):
  scorer = rewards.Scorer(workers=workers, timeout_s=20)
  try:
    scores, stats = scorer.score(user_reward, _items(["4", "5", "4 "]))
  finally:
    scorer.close()
  np.testing.assert_array_equal(scores, [0.5, 0.0, 0.5])
  assert stats == {"mean": pytest.approx(1 / 3), "failures": 0.0, "timeouts": 0.0, "acc": pytest.approx(2 / 3),
                   "len": pytest.approx(4 / 3), "source_is_mine": 1.0}


def test_a_worker_of_the_trainer_imports_its_main_module_without_jax(tmp_path):
  """A spawned worker imports the program's main module again (`python -m tlt_jax.main`'s, as
  multiprocessing prepares it): cheap, seconds of CPU for each of a run's workers otherwise."""
  (tmp_path / "probe.py").write_text(textwrap.dedent("""
      import sys
      def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        main = sys.modules.get("__mp_main__")
        return {"score": float("jax" in sys.modules), "main": float(getattr(main, "__spec__", None) is not None
                                                                     and main.__spec__.name == "tlt_jax.main")}
      """))
  code = ("import importlib.util, sys; from tlt_jax.rl import rewards; "
          "sys.modules['__main__'].__spec__ = importlib.util.find_spec('tlt_jax.main'); "
          "scorer = rewards.Scorer(workers=1, timeout_s=60); "
          f"scores, stats = scorer.score({str(tmp_path / 'probe.py')!r} + ':compute_score', "
          "[rewards.Item('mine', '4', '4', {})]); scorer.close(); print(scores.tolist(), stats['main'])")
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.split() == ["[0.0]", "1.0"], run.stdout  # jax not loaded; the main module was


def test_a_module_reward(tmp_path, monkeypatch):
  (tmp_path / "my_rewards.py").write_text(USER_REWARD)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))  # the workers' import path
  scorer = rewards.Scorer(workers=1, timeout_s=20)
  try:
    scores, _ = scorer.score("my_rewards:compute_score", _items(["4"]))
  finally:
    scorer.close()
  assert scores.tolist() == [0.5]


def test_a_raising_or_hanging_reward_scores_0_and_is_counted_once_logged(user_reward, caplog):
  """The hung worker is replaced: the next batch scores as usual."""
  scorer = rewards.Scorer(workers=2, timeout_s=3)
  try:
    with caplog.at_level(logging.WARNING):
      scores, stats = scorer.score(user_reward, _items(["4", "boom", "hang", "4"]))
    np.testing.assert_array_equal(scores, [0.5, 0.0, 0.0, 0.5])
    assert stats["failures"] == 1 and stats["timeouts"] == 1
    assert "failed on sample 1 (train.jsonl:2): RuntimeError: scorer exploded" in caplog.text
    assert "timed out on sample 2 (train.jsonl:3)" in caplog.text
    assert scorer.score(user_reward, _items(["4"]))[0].tolist() == [0.5]
  finally:
    scorer.close()


@pytest.mark.parametrize("response, what", [("nan", "nan"), ("no score", "a dict without 'score'")])
def test_a_score_that_is_no_number_is_an_error_naming_the_row(user_reward, response, what):
  with pytest.raises(rewards.RewardError, match=f"returned {what} for sample 1 \\(train.jsonl:2\\)"):
    rewards.Scorer(workers=0).score(user_reward, _items(["4", response]))


def test_a_scorer_error_on_a_bad_entry_is_a_failure():
  # A missing or unknown reasoning-gym entry makes the scorer raise: a failure, not a crash.
  entry = {"question": "?", "answer": "1", "metadata": {"source_dataset": "no_such_task"}}
  items = [rewards.Item("chain_sum", "Answer: 1", "1", extra) for extra in ({"entry": entry}, {})]
  scores, stats = rewards.Scorer(workers=0).score("reasoning_gym", items)
  np.testing.assert_array_equal(scores, [0.0, 0.0])
  assert stats["failures"] == 2
