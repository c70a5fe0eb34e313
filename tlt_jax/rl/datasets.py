"""Prompt datasets: procedural reasoning-gym tasks, or local JSONL / Parquet files.

Files may hold rows shaped like Eurus-2-RL or DAPO-Math (verl's format included):
- the prompt under `prompt`, `question` or `problem`, as a string or as chat messages
  (a list of {role, content});
- the ground truth under `reward_model: {ground_truth: ...}`, or top-level `ground_truth`,
  `answer` or `solution` (first found).
Every prompt goes through the tokenizer's chat template with a generation prompt; a template
that fails (jinja2 missing, a broken template) is an error naming the tokenizer and the cause.
Malformed rows, and file rows whose conversation the template rejects (`raise_exception`), are
skipped and counted by reason; the first few are logged with file:line. A file with no usable
row is an error naming it.
"""

import collections
from collections.abc import Iterator, Sequence
import dataclasses
import json
import math
import os
from typing import Any

from absl import logging
import pyarrow.parquet as pq
import transformers

from tlt_jax.rl import rewards
from tlt_jax.rl import tasks
from tlt_jax.rl import tokenizer as tokenizer_lib

_PROMPT_KEYS = ("prompt", "question", "problem")
_GROUND_TRUTH_KEYS = ("ground_truth", "answer", "solution")
_LOGGED_SKIPS = 5  # per file; the rest are only counted

Messages = list[dict[str, str]]


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt, ready for the rollout."""

  prompt_ids: list[int]  # chat-templated, ending with the assistant turn's opening
  prompt: str  # the text prompt_ids encode
  ground_truth: str
  reward: str  # a name in rewards.REWARDS
  metadata: dict[str, Any]  # what the reward reads (e.g. the reasoning-gym entry), provenance
  solution: str | None = None  # a worked solution (procedural tasks), the SFT target


@dataclasses.dataclass(frozen=True)
class Dataset:
  """Examples plus the number of rows skipped, by reason."""

  examples: list[Example]
  skipped: dict[str, int]

  def __len__(self) -> int:
    return len(self.examples)

  def __getitem__(self, index: int) -> Example:
    return self.examples[index]

  def __iter__(self) -> Iterator[Example]:
    return iter(self.examples)


class _Skip(Exception):
  """A malformed row: `reason` is the key it is counted under."""

  def __init__(self, reason: str, detail: str):
    super().__init__(detail)
    self.reason = reason


def load(
    source: str,
    tokenizer: transformers.PreTrainedTokenizerBase,
    *,
    size: int,
    seed: int,
    max_prompt_len: int | None = None,
    reward: str | None = None,
) -> Dataset:
  """A task family name (procedural; size and seed apply) or a .jsonl / .parquet path."""
  if source in tasks.FAMILIES:
    return from_tasks(source, tokenizer, size=size, seed=seed, max_prompt_len=max_prompt_len,
                      reward=reward or "reasoning_gym")
  return from_file(source, tokenizer, max_prompt_len=max_prompt_len, reward=reward or "math_verify")


def from_tasks(
    family: str,
    tokenizer: transformers.PreTrainedTokenizerBase,
    *,
    size: int,
    seed: int,
    difficulty: tasks.Difficulty = tasks.Difficulty(),
    max_prompt_len: int | None = None,
    reward: str = "reasoning_gym",
) -> Dataset:
  """Procedural problems (tasks.generate); too-long prompts are skipped and counted."""
  rewards.get_reward(reward)
  _check_chat_template(tokenizer)
  examples = []
  skipped = collections.Counter()
  for problem in tasks.generate(family, size, seed, difficulty):
    try:
      prompt, prompt_ids = _encode_prompt(
          tokenizer, [{"role": "user", "content": problem.prompt}], max_prompt_len)
    except _Skip as skip:
      skipped[skip.reason] += 1
      continue
    metadata = {"entry": problem.entry, "num_terms": problem.num_terms}
    examples.append(Example(prompt_ids, prompt, problem.answer, reward, metadata, problem.solution))
  if skipped:
    logging.warning("%s: skipped %d of %d problems: %s", family, sum(skipped.values()), size,
                    dict(skipped))
  return Dataset(examples, dict(skipped))


def from_file(
    path: str,
    tokenizer: transformers.PreTrainedTokenizerBase,
    *,
    max_prompt_len: int | None = None,
    reward: str = "math_verify",
) -> Dataset:
  """Rows of a .jsonl or .parquet file; malformed ones are skipped and counted by reason."""
  rewards.get_reward(reward)
  _check_chat_template(tokenizer)
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"dataset file not found: {path} (procedural task families: {sorted(tasks.FAMILIES)})")
  examples = []
  skipped = collections.Counter()
  num_rows = 0
  for line, raw in _read_rows(path):
    num_rows += 1
    try:
      row = _as_row(raw)
      messages = _messages(row)
      ground_truth = _ground_truth(row)
      try:
        prompt, prompt_ids = _encode_prompt(tokenizer, messages, max_prompt_len)
      except tokenizer_lib.ChatTemplateError as e:
        import jinja2  # pylint: disable=import-outside-toplevel  (there: the template ran)
        if not isinstance(e.__cause__, jinja2.TemplateError):
          raise
        # The template works (`_check_chat_template`) but rejects this conversation, e.g. a
        # system turn that is not first.
        raise _Skip("template_error", str(e)) from e
    except _Skip as skip:
      skipped[skip.reason] += 1
      if sum(skipped.values()) <= _LOGGED_SKIPS:
        logging.warning("%s:%d: skipped (%s): %s", path, line, skip.reason, skip)
      continue
    metadata = {"source": f"{path}:{line}"}
    if "data_source" in row:
      metadata["data_source"] = row["data_source"]
    examples.append(Example(prompt_ids, prompt, ground_truth, reward, metadata))
  if not examples:
    raise ValueError(f"{path}: no usable rows ({num_rows} rows; skipped by reason: {dict(skipped)})")
  if skipped:
    logging.warning("%s: skipped %d of %d rows: %s", path, sum(skipped.values()), num_rows,
                    dict(skipped))
  return Dataset(examples, dict(skipped))


def _check_chat_template(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
  """Renders one plain question, so that a template that cannot work fails here, by name."""
  tokenizer_lib.chat_prompt(tokenizer, [{"role": "user", "content": "What is 1 + 1?"}])


def _read_rows(path: str) -> Iterator[tuple[int, bytes | dict[str, Any]]]:
  """(line or row number from 1, raw JSON line or Parquet row)."""
  if path.endswith(".jsonl"):
    with open(path, "rb") as f:
      # Bytes, so that a line that is not UTF-8 is one bad row rather than a failed file.
      for line, raw in enumerate(f, start=1):
        if raw.strip():
          yield line, raw
  elif path.endswith(".parquet"):
    try:
      table = pq.read_table(path)
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise ValueError(f"{path}: not a readable Parquet file: {e}") from e
    yield from enumerate(table.to_pylist(), start=1)
  else:
    raise ValueError(f"{path}: unsupported dataset file type; expected .jsonl or .parquet")


def _as_row(raw: bytes | dict[str, Any]) -> dict[str, Any]:
  if isinstance(raw, dict):
    return raw
  try:
    row = json.loads(raw)  # a UnicodeDecodeError is a ValueError too
  except ValueError as e:
    raise _Skip("bad_json", str(e)) from e
  if not isinstance(row, dict):
    raise _Skip("bad_json", f"expected a JSON object, got {type(row).__name__}")
  try:  # \ud800-style escapes decode to lone surrogates, which no tokenizer takes
    json.dumps(row, ensure_ascii=False).encode()
  except UnicodeEncodeError as e:
    raise _Skip("bad_json", f"not valid Unicode: {e}") from e
  return row


def _messages(row: dict[str, Any]) -> Messages:
  key = next((k for k in _PROMPT_KEYS if row.get(k) is not None), None)
  if key is None:
    raise _Skip("missing_prompt", f"no {' / '.join(_PROMPT_KEYS)} field")
  prompt = row[key]
  if isinstance(prompt, str):
    messages = [{"role": "user", "content": prompt}]
  elif isinstance(prompt, Sequence) and all(_is_message(m) for m in prompt):
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
  else:
    raise _Skip("bad_prompt", f"{key} is neither a string nor a list of {{role, content}}")
  if not any(m["content"].strip() for m in messages):
    raise _Skip("empty_prompt", f"{key} is empty")
  return messages


def _is_message(message: Any) -> bool:
  return (isinstance(message, dict) and isinstance(message.get("role"), str)
          and isinstance(message.get("content"), str))


def _ground_truth(row: dict[str, Any]) -> str:
  reward_model = row.get("reward_model")
  nested = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
  value = nested if nested is not None else next(
      (row[k] for k in _GROUND_TRUTH_KEYS if row.get(k) is not None), None)
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    if isinstance(value, float) and not math.isfinite(value):
      raise _Skip("bad_ground_truth", f"ground truth {value} is not a finite number")
    value = str(value)
  if value is None or (isinstance(value, str) and not value.strip()):
    raise _Skip("missing_ground_truth", "no reward_model.ground_truth or "
                f"{' / '.join(_GROUND_TRUTH_KEYS)} field")
  if not isinstance(value, str):
    raise _Skip("bad_ground_truth", f"ground truth is a {type(value).__name__}, not a string")
  return value


def _encode_prompt(
    tokenizer: transformers.PreTrainedTokenizerBase, messages: Messages, max_prompt_len: int | None
) -> tuple[str, list[int]]:
  text = tokenizer_lib.chat_prompt(tokenizer, messages)
  # The template already wrote the special tokens (BOS, role markers) as text.
  prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
  if max_prompt_len is not None and len(prompt_ids) > max_prompt_len:
    raise _Skip("prompt_too_long", f"{len(prompt_ids)} tokens > max_prompt_len {max_prompt_len}")
  return text, prompt_ids
