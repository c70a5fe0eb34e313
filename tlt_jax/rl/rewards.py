"""Rewards: the built-ins, functions of the user's in verl's or TRL's convention, and how each is called.

`data.reward` (and an evaluation set's `reward`) names one function, or a tuple of them summed with
`data.reward_weights` (default 1 each) as TRL sums its `reward_funcs`. Each is
  * a built-in of REWARDS: "reasoning_gym" (its scorer of the row's dataset on the extracted answer;
    extra_info["entry"] is its item), "math_verify" (the answer line, else \\boxed{} or "the final
    answer is", against the ground truth), "gsm8k" (the number after the last "####", else the last
    number, equal to the ground truth's), "format" (a non-empty `Answer:` line), or "auto" (the default):
    each row by its data_source, reasoning-gym's datasets to reasoning_gym, GSM8K's (verl's
    "openai/gsm8k") to gsm8k, everything else to math_verify;
  * "path/to/file.py:function" or "package.module:function".

A function's calling convention is read from its parameter names (`signature`):
  * TRL: it names `prompts`, `completions` or `completion_ids`. Called once per batch by keyword, as TRL's
    GRPOTrainer calls one: `prompts` (a row's chat messages when its prompt was a chat list, else the prompt
    string), `completions` (then `[{"role": "assistant", "content": text}]`, else the text; with tools the whole
    conversation after the prompt: assistant turns with their "tool_calls" and the "tool" messages), `completion_ids`,
    every column of the rows as a list (but `prompt` and `completion`), `trainer_state` (`global_step`,
    `max_steps`), `log_metric(name, value)` (logged as `reward/<name>`) and `log_extra(column, values)` (a
    value per completion: columns of completions.jsonl). It returns one float per completion, or None where
    it does not apply (left out of the sum; a completion no function applies to scores NaN, as in TRL: out
    of the logged mean and its group's baseline, advantage 0).
  * verl batch: it names `data_sources`, `solution_strs`, `ground_truths` or `extra_infos`: called once per
    batch with those as NumPy object arrays, as verl's BatchRewardManager; it returns a list of floats or dicts.
  * verl: called per response by keyword, `data_source=, solution_str=, ground_truth=, extra_info=`, as
    verl's NaiveRewardManager calls `compute_score`; it returns a float or a dict.
A function gets the keywords it names, or all of them when it takes `**kwargs`; a required parameter its
convention does not pass is an error at start-up. `async def` functions are awaited. A dict's "score" is
the reward and its other numeric keys are logged (`reward/<key>`, a step's mean). A value that is not a
finite number (or None, in TRL's convention) is a bug in the reward: `tlt_jax.rl.scorer` stops on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import math_verify
import numpy as np
import reasoning_gym

from tlt_jax.rl import tasks

RewardFn = Callable[..., Any]

_MATH_VERIFY_TIMEOUT_S = 5
GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")


class RewardError(ValueError):
  """A reward returned something that is not a score, cannot be loaded, or failed on too many samples."""


class Unscorable(ValueError):
  """A built-in reward cannot score a prompt file's rows (they lack what it reads)."""


# ---- the built-ins (verl's signature) ----

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


_NUMBER = r"-?[\d,]*\.?\d+"


def gsm8k_reward(data_source: str | None, solution_str: str | None, ground_truth: str | None,
                 extra_info: Mapping[str, Any] | None = None) -> dict[str, float]:
  """1 if the number after the response's last "####" (else its last number) equals the ground truth as a
  number; "formatted" (logged) says whether it had the "####"."""
  del data_source, extra_info
  marked = re.findall(rf"####\s*({_NUMBER})", solution_str or "")
  found = marked or re.findall(_NUMBER, solution_str or "")
  if not found:
    return {"score": 0.0, "formatted": 0.0}
  try:
    right = abs(float(found[-1].replace(",", "")) - float(str(ground_truth).replace(",", ""))) < 1e-6
  except ValueError:  # a ground truth that is no number
    right = False
  return {"score": float(right), "formatted": float(bool(marked))}


def format_reward(data_source: str | None, solution_str: str | None, ground_truth: str | None,
                  extra_info: Mapping[str, Any] | None = None) -> float:
  """1 if the response ends with a non-empty `Answer:` line."""
  del data_source, ground_truth, extra_info
  return float(tasks.extract_answer(solution_str) is not None)


def _by_source(data_source: str | None) -> RewardFn:
  if data_source in reasoning_gym.factory.DATASETS:
    return reasoning_gym_reward
  return gsm8k_reward if data_source in GSM8K_SOURCES else math_verify_reward


def auto_reward(data_source: str | None, solution_str: str | None, ground_truth: str | None,
                extra_info: Mapping[str, Any] | None = None) -> float | dict[str, float]:
  """By the row's data_source: reasoning-gym's datasets to its scorer, GSM8K's to gsm8k, the rest to
  math_verify."""
  return _by_source(data_source)(data_source, solution_str, ground_truth, extra_info)


REWARDS: dict[str, RewardFn] = {
    "auto": auto_reward,
    "reasoning_gym": reasoning_gym_reward,
    "math_verify": math_verify_reward,
    "gsm8k": gsm8k_reward,
    "format": format_reward,
}


# ---- what a run names ----

@dataclasses.dataclass(frozen=True)
class Reward:
  """The reward functions a prompt set is scored by (specs, module docstring) and their weights."""

  specs: tuple[str, ...]
  weights: tuple[float, ...]

  @classmethod
  def of(cls, spec: str | Sequence[str] | Reward, weights: Sequence[float] = ()) -> Reward:
    """From a config's `reward` (one spec or a tuple) and `reward_weights` (() = 1 each)."""
    if isinstance(spec, Reward):
      return spec
    specs = (spec,) if isinstance(spec, str) else tuple(spec)
    if not specs or not all(isinstance(s, str) and s for s in specs):
      raise RewardError(f"must name a reward, or a tuple of them; got {spec!r}")
    weights = tuple(weights) or (1.0,) * len(specs)
    if len(weights) != len(specs):
      raise RewardError(f"{len(weights)} reward weights for {len(specs)} reward functions")
    if not all(isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
      raise RewardError(f"reward weights must be finite numbers; got {weights!r}")
    return cls(specs, tuple(float(w) for w in weights))

  def names(self) -> list[str]:
    """Each function's name as its mean is logged (`reward/<name>`): its own, else its spec when two share one."""
    names = [getattr(load(s), "__name__", None) or s.rpartition(":")[2] for s in self.specs]
    return names if len(set(names)) == len(names) else list(self.specs)

  def __str__(self) -> str:
    return repr(self.specs[0]) if len(self.specs) == 1 else repr(self.specs)


@dataclasses.dataclass(frozen=True)
class Item:
  """One response to score, and the row it answers (`where`: its file:line, named in errors)."""

  data_source: str | None
  solution_str: str | None
  ground_truth: str | None
  extra_info: Mapping[str, Any]
  where: str = ""
  prompt: str | list[dict[str, str]] | None = None  # TRL's `prompts` entry: chat messages, or the prompt string
  completion_ids: Sequence[int] = ()
  columns: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # every column of the row
  conversation: list[dict[str, Any]] | None = None  # a multi-turn response's messages (TRL's completion)


@dataclasses.dataclass(frozen=True)
class TrainerState:
  """What a TRL reward function reads as `trainer_state` (the fields of TRL's it has)."""

  global_step: int = 0  # RL steps done before this batch
  max_steps: int = 0


# ---- loading and conventions ----

def import_function(spec: str, what: str, builtins: Mapping[str, Callable[..., Any]],
                    error: type[Exception]) -> Callable[..., Any]:
  """The function `spec` names: a key of `builtins`, "path/to/file.py:function" or "package.module:function"; an
  `error` names `what` (e.g. "reward"), the spec and why it cannot be loaded."""
  if spec in builtins:
    return builtins[spec]
  where, _, name = spec.rpartition(":")
  if not where or not name:
    raise error(f"unknown {what} {spec!r}: one of {sorted(builtins)}, 'path/to/file.py:function' or "
                "'package.module:function'")
  try:
    if where.endswith(".py"):
      if not os.path.isfile(where):
        raise FileNotFoundError(f"no such file: {where}")
      module_spec = importlib.util.spec_from_file_location(f"_{what}_{abs(hash(where))}", where)
      module = importlib.util.module_from_spec(module_spec)
      module_spec.loader.exec_module(module)
    else:
      module = importlib.import_module(where)
  except Exception as e:  # pylint: disable=broad-exception-caught  (whatever the user's module raises)
    raise error(f"{what} {spec!r}: cannot import {where}: {type(e).__name__}: {e}") from None
  fn = getattr(module, name, None)
  if not callable(fn):
    raise error(f"{what} {spec!r}: {where} has no function {name!r}")
  return fn


@functools.cache
def load(spec: str) -> RewardFn:
  """The function `spec` names (module docstring); a RewardError says why it cannot be loaded."""
  return import_function(spec, "reward", REWARDS, RewardError)


TRL_NAMES = ("prompts", "completions", "completion_ids")
TRL_EXTRAS = ("trainer_state", "log_metric", "log_extra")
UNPASSED_COLUMNS = ("prompt", "completion")  # TRL passes every other column of the row
VERL_BATCH_NAMES = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
VERL_NAMES = ("data_source", "solution_str", "ground_truth", "extra_info")


@dataclasses.dataclass(frozen=True)
class Signature:
  """How a reward function is called: its convention ("trl", "verl_batch" or "verl"), the keywords it takes
  (None: any, it has **kwargs) and those it requires."""

  convention: str
  takes: frozenset[str] | None
  required: tuple[str, ...]

  @property
  def batched(self) -> bool:
    return self.convention != "verl"

  def kwargs(self, given: dict[str, Any]) -> dict[str, Any]:
    return given if self.takes is None else {k: v for k, v in given.items() if k in self.takes}


@functools.cache
def signature(spec: str) -> Signature:
  """The convention of the function `spec` names, from its parameter names (module docstring)."""
  fn = load(spec)
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError) as e:
    raise RewardError(f"reward {spec!r}: cannot read its parameters: {e}") from None
  keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
  names = {p.name for p in params if p.kind in keyword}
  any_keyword = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
  required = tuple(p.name for p in params if p.default is inspect.Parameter.empty
                   and p.kind in (*keyword, inspect.Parameter.POSITIONAL_ONLY))
  if names & set(TRL_NAMES):
    convention, passed = "trl", None  # with the dataset's columns: checked by `check` once they are known
  elif names & set(VERL_BATCH_NAMES):
    convention, passed = "verl_batch", VERL_BATCH_NAMES
  elif names & set(VERL_NAMES) or any_keyword:
    convention, passed = "verl", VERL_NAMES
  else:
    raise RewardError(f"reward {spec!r}: its parameters ({', '.join(p.name for p in params) or 'none'}) name none "
                      f"of verl's ({', '.join(VERL_NAMES)}), verl's batch ones ({', '.join(VERL_BATCH_NAMES)}) or "
                      f"TRL's ({', '.join(TRL_NAMES)}), so it cannot be called by keyword as they call one")
  missing = [name for name in required if passed is not None and name not in passed]
  if missing:
    raise RewardError(f"reward {spec!r}: its required parameter {missing[0]!r} is none that {convention} passes "
                      f"({', '.join(passed)}); give it a default")
  return Signature(convention, None if any_keyword else frozenset(names), required)


def check(reward: str | Sequence[str] | Reward, columns: Sequence[str] | None = None) -> Reward:
  """Loads the functions `reward` names and reads their conventions (a RewardError says why one cannot be
  used). With `columns` (the prompt file's), a TRL function's required parameters must be among them."""
  reward = Reward.of(reward)
  for spec in reward.specs:
    sig = signature(spec)
    if sig.convention == "trl" and columns is not None:
      passed = sorted(set(columns) - set(UNPASSED_COLUMNS))  # as TRL: the prompt is `prompts`, never its column
      missing = [name for name in sig.required if name not in {*TRL_NAMES, *TRL_EXTRAS, *passed}]
      if missing:
        hint = f" (TRL passes the prompts as {TRL_NAMES[0]!r})" if missing[0] == "prompt" else ""
        raise RewardError(f"reward {spec!r}: its required parameter {missing[0]!r} is neither TRL's "
                          f"({', '.join(TRL_NAMES + TRL_EXTRAS)}) nor a column of the prompts passed to it "
                          f"({', '.join(passed)}){hint}")
  return reward


def cannot_score(reward: Reward, item: Item) -> str | None:
  """Why a built-in of `reward` cannot score `item`'s row (None: it can): reasoning_gym reads the row's
  reasoning-gym entry, which only tlt_jax's procedural tasks (or files that keep it) hold."""
  for spec in reward.specs:
    if spec == "reasoning_gym" or (spec == "auto" and _by_source(item.data_source) is reasoning_gym_reward):
      entry = item.extra_info.get("entry") if isinstance(item.extra_info, Mapping) else None
      if not (isinstance(entry, Mapping) and isinstance(entry.get("metadata"), Mapping)
              and "source_dataset" in entry["metadata"]):
        return (f"reward {spec!r} scores it with reasoning-gym's scorer, which reads the row's reasoning-gym entry "
                f"(extra_info.entry), and the row has none")
  return None


# ---- calling ----

def _resolved(value: Any) -> Any:
  """`value`, awaited when it is awaitable (an `async def` reward's); in a thread of its own when this one
  already runs an event loop (a notebook)."""
  if not inspect.isawaitable(value):
    return value
  async def wait():
    return await value
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    return asyncio.run(wait())
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(asyncio.run, wait()).result()


def _plain(value: Any) -> Any:
  """Arrays and tensors as lists, NumPy scalars as Python numbers (what crosses a process boundary)."""
  if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
    return value.tolist()
  return value


def call(spec: str, items: Sequence[Item], state: TrainerState | None = None) -> tuple[str, Any, dict, dict]:
  """("ok", one value per item, metrics the function logged, columns it logged with `log_extra`) or ("error",
  what it raised, {}, {}). A per-response (verl) function is called once per item, a batch one once."""
  metrics: dict[str, list[float]] = {}
  columns: dict[str, list] = {}
  try:
    fn, sig = load(spec), signature(spec)
    if sig.convention == "verl":
      values = [_plain(_resolved(fn(**sig.kwargs(dict(zip(VERL_NAMES, (i.data_source, i.solution_str, i.ground_truth,
                                                                        dict(i.extra_info)))))))) for i in items]
    elif sig.convention == "verl_batch":  # numpy object arrays, as verl's non-tensor batch holds them
      values = _plain(_resolved(fn(**sig.kwargs(dict(zip(VERL_BATCH_NAMES, (_objects(column) for column in (
          [i.data_source for i in items], [i.solution_str for i in items], [i.ground_truth for i in items],
          [dict(i.extra_info) for i in items]))))))))
    else:
      values = _plain(_resolved(fn(**sig.kwargs(_trl_kwargs(items, state or TrainerState(), metrics, columns)))))
    return "ok", values, {k: sum(v) / len(v) for k, v in metrics.items()}, columns
  except Exception as e:  # pylint: disable=broad-exception-caught  (a bad sample must not stop a step)
    return "error", f"{type(e).__name__}: {e}", {}, {}


def _objects(values: list) -> np.ndarray:
  array = np.empty(len(values), dtype=object)
  array[:] = values
  return array


def _trl_kwargs(items: Sequence[Item], state: TrainerState, metrics: dict[str, list[float]],
                columns: dict[str, list]) -> dict[str, Any]:
  """What TRL's GRPOTrainer passes a reward function for this batch (module docstring)."""
  def log_metric(name: str, value: float) -> None:
    metrics.setdefault(name, []).append(float(value))

  def log_extra(column: str, values: Sequence) -> None:
    columns.setdefault(column, []).extend(_plain(list(values)))
  completions = [i.conversation if i.conversation is not None
                 else [{"role": "assistant", "content": i.solution_str or ""}] if isinstance(i.prompt, list)
                 else i.solution_str or "" for i in items]
  row_columns = dict.fromkeys(k for i in items for k in i.columns if k not in (*UNPASSED_COLUMNS, *TRL_NAMES))
  return {"prompts": [i.prompt for i in items], "completions": completions,
          "completion_ids": [list(i.completion_ids) for i in items],
          **{k: [i.columns.get(k) for i in items] for k in row_columns}, "trainer_state": state,
          "log_metric": log_metric, "log_extra": log_extra}
