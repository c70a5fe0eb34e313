"""Tests for tlt_jax/rl/rewards.py."""

import logging
import threading

import numpy as np
import pytest

from tlt_jax.rl import rewards
from tlt_jax.rl import tasks


@pytest.fixture(scope="module")
def problem():
  return tasks.generate("chain_sum", 8, seed=0)[-1]


def test_reasoning_gym_reward(problem):
  reward = rewards.get_reward("reasoning_gym")
  metadata = {"entry": problem.entry}
  assert reward(problem.solution, problem.answer, metadata) == 1.0
  wrong = f"Answer: {int(problem.answer) + 1}"
  for response in (wrong, "%%garbage%%", "", None, problem.answer):  # bare answer: no format
    assert reward(response, problem.answer, metadata) < 1.0


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
  assert rewards.get_reward("math_verify")(response, ground_truth, {}) == float(correct)


def test_math_verify_reward_off_the_main_thread():
  # math-verify's SIGALRM timeout only works on the main thread; we turn it off elsewhere.
  scores = []
  thread = threading.Thread(
      target=lambda: scores.append(rewards.math_verify_reward("Answer: 3", "3", {})))
  thread.start()
  thread.join()
  assert scores == [1.0]


@pytest.mark.parametrize(
    "response, score",
    [("1+1=2\nAnswer: 2", 1.0), ("Answer: x", 1.0), ("Answer:", 0.0), ("2", 0.0), (None, 0.0)],
)
def test_format_reward(response, score):
  assert rewards.get_reward("format")(response, None, {}) == score


def test_unknown_reward_lists_known_names():
  with pytest.raises(ValueError, match="known: .*format.*math_verify.*reasoning_gym"):
    rewards.get_reward("accuracy")


def test_score_batch(problem):
  responses = [problem.solution, "garbage", "", None]
  scores_B, stats = rewards.score_batch(
      "reasoning_gym", responses, [problem.answer] * 4, [{"entry": problem.entry}] * 4)
  np.testing.assert_array_equal(scores_B, [1.0, 0.0, 0.0, 0.0])
  assert stats == {"mean": 0.25, "failures": 0.0}


def test_score_batch_survives_a_raising_reward(monkeypatch, caplog):
  def flaky(response, ground_truth, metadata):
    del ground_truth, metadata
    if response == "boom":
      raise RuntimeError("scorer exploded")
    return float("nan") if response == "nan" else 1.0

  monkeypatch.setitem(rewards.REWARDS, "flaky", flaky)
  with caplog.at_level(logging.WARNING):
    scores_B, stats = rewards.score_batch("flaky", ["ok", "boom", "nan", "ok"], [None] * 4)
  np.testing.assert_array_equal(scores_B, [1.0, 0.0, 0.0, 1.0])
  assert stats == {"mean": 0.5, "failures": 2.0}
  assert "sample 1" in caplog.text and "scorer exploded" in caplog.text
  assert "sample 2" in caplog.text and "non-finite" in caplog.text


def test_score_batch_counts_a_scorer_error_on_bad_metadata():
  # A missing or unknown reasoning-gym entry makes the scorer raise: a failure, not a crash.
  entry = {"question": "?", "answer": "1", "metadata": {"source_dataset": "no_such_task"}}
  scores_B, stats = rewards.score_batch(
      "reasoning_gym", ["Answer: 1", "Answer: 1"], ["1", "1"], [{"entry": entry}, {}])
  np.testing.assert_array_equal(scores_B, [0.0, 0.0])
  assert stats["failures"] == 2


def test_score_batch_rejects_mismatched_lengths():
  with pytest.raises(ValueError, match="batch sizes differ"):
    rewards.score_batch("format", ["a", "b"], ["a"])
