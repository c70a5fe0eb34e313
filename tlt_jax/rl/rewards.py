"""Rewards: built-in ones by name or a function of the user's, scored in a pool of worker processes.

Every reward has verl's custom-reward signature, so a verl user's reward file works unchanged:

  compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

A dict's "score" is the reward and its other numeric keys are logged (`reward/<key>`, a step's mean).
`data.reward` (and an evaluation set's `reward`) names one:
  * a built-in of REWARDS: "reasoning_gym" (its scorer of the row's dataset on the extracted answer;
    extra_info["entry"] is its item), "math_verify" (the answer line, else \\boxed{} or "the final
    answer is", against the ground truth), "format" (a non-empty `Answer:` line), or "auto": each row
    by its data_source, reasoning-gym's datasets to reasoning_gym and everything else to math_verify;
  * "path/to/file.py:function" or "package.module:function".
`check` imports it at start-up, so a reward that cannot be loaded stops the run before anything else.

`Scorer` runs the calls in a pool of worker processes (spawned: rewards never share the trainer's
threads), each call under a timeout: a reward that raises or hangs scores 0, is counted
(`reward/failures`, `reward/timeouts`) and logged for the first few samples with the sample's index;
a hung worker is replaced. A score that is not a finite number, or a dict without "score", is a
`RewardError` naming the row: a bug in the reward rather than a hard sample. `workers=0` scores in
this process, with no timeout.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import math
import multiprocessing
import numbers
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import math_verify
import numpy as np
import reasoning_gym
from absl import logging

from tlt_jax.rl import tasks

RewardFn = Callable[..., float | dict]

_MATH_VERIFY_TIMEOUT_S = 5
_LOGGED = 3  # failures and timeouts logged per batch; the rest are counted


class RewardError(ValueError):
  """A reward returned something that is not a score, or cannot be loaded."""


def reasoning_gym_reward(data_source: str | None, solution_str: str | None, ground_truth: str | None,
                         extra_info: Mapping[str, Any] | None = None) -> float:
  """reasoning-gym's own scorer on the extracted answer; extra_info['entry'] is its item."""
  del data_source, ground_truth  # the entry names its dataset and holds its answer (its scorer may read more)
  entry = (extra_info or {})["entry"]
  return _reasoning_gym_scorer(entry["metadata"]["source_dataset"])(tasks.extract_answer(solution_str), entry)


@functools.cache
def _reasoning_gym_scorer(name: str) -> Callable[[str | None, dict[str, Any]], float]:
  return reasoning_gym.get_score_answer_fn(name)


def math_verify_reward(data_source: str | None, solution_str: str | None, ground_truth: str | None,
                       extra_info: Mapping[str, Any] | None = None) -> float:
  """1 if math-verify finds the answer equal to the ground truth.

  The answer is the `Answer:` line when there is one, else whatever math-verify extracts
  from the whole response (last \\boxed{}, "final answer is ...").
  """
  del data_source, extra_info
  if ground_truth is None:
    raise ValueError("math_verify needs a ground truth")
  # math-verify times out with SIGALRM, which only the main thread may set.
  timeout = _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
  # A bare gold like "x^2+1" parses only inside math delimiters; \boxed{} is one.
  if "\\boxed" not in ground_truth:
    ground_truth = f"\\boxed{{{ground_truth}}}"
  gold = math_verify.parse(ground_truth, parsing_timeout=timeout)
  answer = tasks.extract_answer(solution_str)
  prediction = math_verify.parse(
      (solution_str or "") if answer is None else f"\\boxed{{{answer}}}", parsing_timeout=timeout)
  return float(math_verify.verify(gold, prediction, timeout_seconds=timeout))


def format_reward(data_source: str | None, solution_str: str | None, ground_truth: str | None,
                  extra_info: Mapping[str, Any] | None = None) -> float:
  """1 if the response ends with a non-empty `Answer:` line."""
  del data_source, ground_truth, extra_info
  return float(tasks.extract_answer(solution_str) is not None)


def auto_reward(data_source: str | None, solution_str: str | None, ground_truth: str | None,
                extra_info: Mapping[str, Any] | None = None) -> float:
  """By the row's data_source: a reasoning-gym dataset's rows to its scorer, the rest to math_verify."""
  fn = reasoning_gym_reward if data_source in reasoning_gym.factory.DATASETS else math_verify_reward
  return fn(data_source, solution_str, ground_truth, extra_info)


REWARDS: dict[str, RewardFn] = {
    "reasoning_gym": reasoning_gym_reward,
    "math_verify": math_verify_reward,
    "format": format_reward,
    "auto": auto_reward,
}


@functools.cache
def load(spec: str) -> RewardFn:
  """The reward `spec` names (module docstring); a RewardError says why it cannot be loaded."""
  if spec in REWARDS:
    return REWARDS[spec]
  where, _, name = spec.rpartition(":")
  if not where or not name:
    raise RewardError(f"unknown reward {spec!r}: one of {sorted(REWARDS)}, 'path/to/file.py:function' or "
                      "'package.module:function'")
  try:
    if where.endswith(".py"):
      if not os.path.isfile(where):
        raise FileNotFoundError(f"no such file: {where}")
      module_spec = importlib.util.spec_from_file_location(f"_reward_{abs(hash(where))}", where)
      module = importlib.util.module_from_spec(module_spec)
      module_spec.loader.exec_module(module)
    else:
      module = importlib.import_module(where)
  except Exception as e:  # pylint: disable=broad-exception-caught  (whatever the user's module raises)
    raise RewardError(f"reward {spec!r}: cannot import {where}: {type(e).__name__}: {e}") from None
  fn = getattr(module, name, None)
  if not callable(fn):
    raise RewardError(f"reward {spec!r}: {where} has no function {name!r}")
  return fn


def check(spec: str) -> None:
  """Loads the reward `spec` names (a RewardError says why it cannot be)."""
  load(spec)


@dataclasses.dataclass(frozen=True)
class Item:
  """One response to score, and where its row came from (named in errors)."""

  data_source: str | None
  solution_str: str | None
  ground_truth: str | None
  extra_info: Mapping[str, Any]
  where: str = ""


def _call(spec: str, item: Item | None) -> tuple[str, Any]:
  """("ok", the reward's result) or ("error", what it raised): in a worker, or here. No item: loads it."""
  try:
    fn = load(spec)
    if item is None:
      return "ok", None
    return "ok", fn(item.data_source, item.solution_str, item.ground_truth, dict(item.extra_info))
  except Exception as e:  # pylint: disable=broad-exception-caught  (a bad sample must not stop a step)
    return "error", f"{type(e).__name__}: {e}"


def _number(value: Any) -> float | None:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    return None
  value = float(value)
  return value if math.isfinite(value) else None


class Scorer:
  """Scores batches of responses with named rewards (module docstring)."""

  def __init__(self, workers: int = 4, timeout_s: float = 60.0):
    self.workers, self.timeout_s = workers, timeout_s
    self._pool, self._loaded = None, set()

  def _get_pool(self, spec: str):
    """The pool, its workers started and `spec` loaded in them (a worker's start, imports included, takes
    seconds: it is not a call's time)."""
    if self._pool is None:
      self._pool = multiprocessing.get_context("spawn").Pool(self.workers)
      self._loaded = set()
    if spec not in self._loaded:
      try:
        self._pool.starmap_async(_call, [(spec, None)] * self.workers, chunksize=1).get(
            timeout=max(120.0, 10 * self.timeout_s))
      except multiprocessing.TimeoutError:
        self._restart()
        raise RewardError(f"reward {spec!r}: the reward workers did not start in time") from None
      self._loaded.add(spec)
    return self._pool

  def _restart(self) -> None:
    """Replaces the pool (its hung workers are killed)."""
    self._pool.terminate()
    self._pool.join()
    self._pool = None

  def score(self, spec: str, items: Sequence[Item]) -> tuple[np.ndarray, dict[str, float]]:
    """(scores [N], stats): the mean, `failures` and `timeouts` (each such sample scored 0) and the
    mean of every other numeric key the reward's dicts return."""
    check(spec)
    if self.workers:
      pool = self._get_pool(spec)
      pending = [pool.apply_async(_call, (spec, item)) for item in items]
      results, hung = [], False
      for p in pending:
        try:
          results.append(p.get(timeout=self.timeout_s))
        except multiprocessing.TimeoutError:
          results.append(("timeout", f"no result in {self.timeout_s:g} s"))
          hung = True
      if hung:
        self._restart()
    else:
      results = [_call(spec, item) for item in items]
    scores = np.zeros(len(items), np.float32)
    counts, extras, logged = {"error": 0, "timeout": 0}, {}, 0
    for i, ((kind, value), item) in enumerate(zip(results, items)):
      if kind != "ok":
        counts[kind] += 1
        if logged < _LOGGED:
          logged += 1
          logging.warning("reward %r %s on sample %d (%s): %s; scored 0", spec,
                          "failed" if kind == "error" else "timed out", i, item.where or "no source", value)
        continue
      score = value.get("score") if isinstance(value, Mapping) else value
      if _number(score) is None:
        got = "a dict without 'score'" if isinstance(value, Mapping) and "score" not in value else repr(score)
        raise RewardError(f"reward {spec!r} returned {got} for sample {i} ({item.where or 'no source'}): "
                          "a reward must return a finite number or a dict with a 'score'")
      scores[i] = score
      if isinstance(value, Mapping):
        for key, x in value.items():
          if key != "score" and _number(x) is not None:
            extras.setdefault(key, []).append(float(x))
    if counts["error"] + counts["timeout"] > logged:
      logging.warning("reward %r: %d of %d samples failed, %d timed out", spec, counts["error"], len(items),
                      counts["timeout"])
    stats = {"mean": float(scores.mean()) if len(scores) else 0.0, "failures": float(counts["error"]),
             "timeouts": float(counts["timeout"]), **{k: float(np.mean(v)) for k, v in extras.items()}}
    return scores, stats

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()
      self._pool.join()
      self._pool = None
