"""Rewards picked by name, and batch scoring that survives a failing sample.

A reward maps (response, ground truth, example metadata) to a score in [0, 1]. Responses
end with the tiny world's answer line (`Answer: <value>`, see tasks.py); `math_verify` also
reads \\boxed{} answers and "the final answer is" sentences of real models.
"""

from collections.abc import Callable, Mapping, Sequence
import functools
import math
import threading
from typing import Any

from absl import logging
import math_verify
import numpy as np
import reasoning_gym

from tlt_jax.rl import tasks

RewardFn = Callable[[str | None, str | None, Mapping[str, Any]], float]

_MATH_VERIFY_TIMEOUT_S = 5
_LOGGED_FAILURES = 3  # per batch; the rest are only counted


def reasoning_gym_reward(
    response: str | None, ground_truth: str | None, metadata: Mapping[str, Any]
) -> float:
  """reasoning-gym's own scorer on the extracted answer; metadata['entry'] is its item."""
  del ground_truth  # the entry holds reasoning-gym's answer, and its scorer may read more
  entry = metadata["entry"]
  scorer = _reasoning_gym_scorer(entry["metadata"]["source_dataset"])
  return scorer(tasks.extract_answer(response), entry)


@functools.cache
def _reasoning_gym_scorer(name: str) -> Callable[[str | None, dict[str, Any]], float]:
  return reasoning_gym.get_score_answer_fn(name)


def math_verify_reward(
    response: str | None, ground_truth: str | None, metadata: Mapping[str, Any]
) -> float:
  """1 if math-verify finds the answer equal to the ground truth.

  The answer is the `Answer:` line when there is one, else whatever math-verify extracts
  from the whole response (last \\boxed{}, "final answer is ...").
  """
  del metadata
  if ground_truth is None:
    raise ValueError("math_verify needs a ground truth")
  # math-verify times out with SIGALRM, which only the main thread may set.
  timeout = _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
  # A bare gold like "x^2+1" parses only inside math delimiters; \boxed{} is one.
  if "\\boxed" not in ground_truth:
    ground_truth = f"\\boxed{{{ground_truth}}}"
  gold = math_verify.parse(ground_truth, parsing_timeout=timeout)
  answer = tasks.extract_answer(response)
  prediction = math_verify.parse(
      (response or "") if answer is None else f"\\boxed{{{answer}}}", parsing_timeout=timeout)
  return float(math_verify.verify(gold, prediction, timeout_seconds=timeout))


def format_reward(
    response: str | None, ground_truth: str | None, metadata: Mapping[str, Any]
) -> float:
  """1 if the response ends with a non-empty `Answer:` line."""
  del ground_truth, metadata
  return float(tasks.extract_answer(response) is not None)


REWARDS: dict[str, RewardFn] = {
    "reasoning_gym": reasoning_gym_reward,
    "math_verify": math_verify_reward,
    "format": format_reward,
}


def get_reward(name: str) -> RewardFn:
  if name not in REWARDS:
    raise ValueError(f"unknown reward {name!r}; known: {sorted(REWARDS)}")
  return REWARDS[name]


def score_batch(
    reward: str,
    responses: Sequence[str | None],
    ground_truths: Sequence[str | None],
    metadata: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[np.ndarray, dict[str, float]]:
  """Scores a batch; returns (scores_B, {'mean', 'failures'}).

  A sample whose reward raises or is not a finite number scores 0 and counts as a failure,
  so one bad response (or scorer bug on one input) cannot stop an RL step.
  """
  fn = get_reward(reward)
  if metadata is None:
    metadata = [{}] * len(responses)
  if not len(responses) == len(ground_truths) == len(metadata):
    raise ValueError(
        f"batch sizes differ: {len(responses)} responses, {len(ground_truths)} ground truths, "
        f"{len(metadata)} metadata")
  scores_B = np.zeros(len(responses), np.float32)
  failures = 0
  for i, (response, ground_truth, meta) in enumerate(zip(responses, ground_truths, metadata)):
    try:
      score = float(fn(response, ground_truth, meta))
      if not math.isfinite(score):
        raise ValueError(f"non-finite score {score}")
    except Exception as e:  # pylint: disable=broad-exception-caught
      failures += 1
      if failures <= _LOGGED_FAILURES:
        logging.warning("reward %r failed on sample %d: %r", reward, i, e)
      continue
    scores_B[i] = score
  if failures > _LOGGED_FAILURES:
    logging.warning("reward %r failed on %d of %d samples", reward, failures, len(responses))
  mean = float(scores_B.mean()) if len(scores_B) else 0.0
  return scores_B, {"mean": mean, "failures": float(failures)}
