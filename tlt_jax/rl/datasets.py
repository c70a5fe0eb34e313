"""Prompt datasets: procedural reasoning-gym tasks, or local files: JSONL, Parquet, or a directory
saved by Hugging Face `datasets` (`save_to_disk`; read with `datasets`, the `data` extra).

Rows are found by `Keys` (config: `data.prompt_key`, `data.answer_key`, `data.answer_regex`,
`data.system_prompt`); by default they may be shaped like Eurus-2-RL, DAPO-Math or GSM8K (verl's
format included):
- the prompt under `prompt`, `question` or `problem`, as a string or as chat messages
  (a list of {role, content});
- the ground truth under `reward_model: {ground_truth: ...}`, or top-level `ground_truth`,
  `answer` or `solution` (first found); a key may be a dotted path (`reward_model.ground_truth`),
  and `answer_regex`'s first group takes the answer out of it where it matches (`#### (.*)` for GSM8K's
  answers; a ground truth it does not match, e.g. verl's bare "72", is taken as it is);
- `data_source` and `extra_info` pass through to the reward (tlt_jax.rl.rewards), and a TRL-style reward
  function gets every column.
So verl's preprocessed files (`prompt` as chat messages, `reward_model.ground_truth`, `data_source`,
`extra_info`) and TRL's (`prompt`, a column with the answer) need no keys set.
A key a file does not have at all is an error naming it and the file's columns. Every prompt goes
through the tokenizer's chat template with a generation prompt (after `system_prompt`, if set); a
template that fails (jinja2 missing, a broken template) is an error naming the tokenizer and the
cause. Malformed rows, and file rows whose conversation the template rejects (`raise_exception`),
are skipped and counted by reason; the first few are logged with file:line. A file with no usable
row is an error naming it, and so is a row its reward cannot score (`rewards.Unscorable`: a built-in
that reads what the row lacks) or a TRL reward whose required parameter is no column.
"""

import collections
from collections.abc import Iterator, Sequence
import dataclasses
import json
import math
import os
import re
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
_TASK_COLUMNS = ("prompt", "ground_truth", "data_source", "extra_info")  # a procedural problem's, as a row

Messages = list[dict[str, str]]


@dataclasses.dataclass(frozen=True)
class Keys:
  """Where a file's rows hold what an Example needs. Config: `data.*` (and each evaluation set's)."""

  prompt_key: str = ""  # "" = the first of prompt / question / problem
  answer_key: str = ""  # dotted path; "" = reward_model.ground_truth, else ground_truth / answer / solution
  answer_regex: str = ""  # where it matches, its first group (else the whole match) is the ground truth
  system_prompt: str = ""  # a system turn before every prompt that has none

  def __post_init__(self):
    if self.answer_regex:
      try:
        re.compile(self.answer_regex)
      except re.error as e:
        raise ValueError(f"answer_regex {self.answer_regex!r}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt, ready for the rollout."""

  prompt_ids: list[int]  # chat-templated, ending with the assistant turn's opening
  prompt: str  # the text prompt_ids encode
  ground_truth: str
  reward: rewards.Reward  # what scores it
  data_source: str | None  # the row's (a procedural task's: its reasoning-gym dataset)
  extra_info: dict[str, Any]  # what the reward reads beside (e.g. the reasoning-gym entry)
  where: str  # its file:line (or task and number), named in errors
  solution: str | None = None  # a worked solution (procedural tasks), the SFT target
  messages: Messages = dataclasses.field(default_factory=list)  # the conversation prompt_ids encode
  columns: dict[str, Any] = dataclasses.field(default_factory=dict)  # the row as read (TRL rewards get them)
  row_prompt: Any = None  # the row's prompt as read (None: its user turn): TRL's `prompts` entry

  def item(self, response: str | None, response_ids: Sequence[int] = (), extra: dict | None = None,
           conversation: list[dict] | None = None) -> rewards.Item:
    """`response` (its tokens: `response_ids`) to this prompt, as the reward scores it; `extra` joins
    `extra_info` (a trajectory's turns and tool calls), `conversation` is a multi-turn response's messages
    (`tools.conversation`). TRL-style functions get the row's own prompt (without data.system_prompt, which
    TRL never adds)."""
    prompt = self.messages[-1]["content"] if self.row_prompt is None else self.row_prompt
    return rewards.Item(self.data_source, response, self.ground_truth, {**self.extra_info, **(extra or {})},
                        self.where, prompt, tuple(response_ids), self.columns, conversation)


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
    tools: Sequence[dict] | None = None,
    reward: str | Sequence[str] | rewards.Reward = "auto",
    keys: Keys = Keys(),
) -> Dataset:
  """A task family name (procedural; size and seed apply) or a file (`from_file`)."""
  if source in tasks.FAMILIES:
    return from_tasks(source, tokenizer, size=size, seed=seed, max_prompt_len=max_prompt_len, reward=reward,
                      tools=tools)
  return from_file(source, tokenizer, keys=keys, max_prompt_len=max_prompt_len, reward=reward, tools=tools)


def from_tasks(
    family: str,
    tokenizer: transformers.PreTrainedTokenizerBase,
    *,
    size: int,
    seed: int,
    difficulty: tasks.Difficulty = tasks.Difficulty(),
    max_prompt_len: int | None = None,
    tools: Sequence[dict] | None = None,
    reward: str | Sequence[str] | rewards.Reward = "auto",
) -> Dataset:
  """Procedural problems (tasks.generate); too-long prompts are skipped and counted. A TRL reward gets
  their columns `prompt`, `ground_truth`, `data_source` and `extra_info` (`entry`: reasoning-gym's item).
  `tools`: JSON schemas the chat template shows in every prompt (multi-turn rollouts, tlt_jax.rl.tools)."""
  reward = rewards.check(reward, _TASK_COLUMNS)
  _check_chat_template(tokenizer)
  examples = []
  skipped = collections.Counter()
  for number, problem in enumerate(tasks.generate(family, size, seed, difficulty)):
    messages = [{"role": "user", "content": problem.prompt}]
    try:
      prompt, prompt_ids = _encode_prompt(tokenizer, messages, max_prompt_len, tools)
    except _Skip as skip:
      skipped[skip.reason] += 1
      continue
    source = problem.entry["metadata"]["source_dataset"]
    extra_info = {"entry": problem.entry, "num_terms": problem.num_terms}
    examples.append(Example(prompt_ids, prompt, problem.answer, reward, source, extra_info, f"{family} #{number}",
                            problem.solution, messages,
                            columns=dict(zip(_TASK_COLUMNS, (problem.prompt, problem.answer, source, extra_info)))))
  if skipped:
    logging.warning("%s: skipped %d of %d problems: %s", family, sum(skipped.values()), size,
                    dict(skipped))
  return Dataset(examples, dict(skipped))


def from_file(
    path: str,
    tokenizer: transformers.PreTrainedTokenizerBase,
    *,
    keys: Keys = Keys(),
    max_prompt_len: int | None = None,
    tools: Sequence[dict] | None = None,
    reward: str | Sequence[str] | rewards.Reward = "auto",
) -> Dataset:
  """Rows of a .jsonl or .parquet file or a `datasets` directory (module docstring); malformed ones are
  skipped and counted by reason. A row `reward` cannot score is an error (`rewards.Unscorable`). `tools`:
  as `from_tasks`'."""
  reward = rewards.check(reward)
  _check_chat_template(tokenizer)
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"dataset file not found: {path} (procedural task families: {sorted(tasks.FAMILIES)})")
  examples = []
  skipped = collections.Counter()
  num_rows = 0
  regex = re.compile(keys.answer_regex) if keys.answer_regex else None
  checked = False
  for line, raw in _read_rows(path):
    num_rows += 1
    try:
      row = _as_row(raw)
      if not checked:  # the first row that parses
        _check_keys(path, row, keys)
        try:
          rewards.check(reward, list(row))
        except rewards.RewardError as e:
          raise ValueError(f"{path}: {e}") from None
        checked = True
      messages = _messages(row, keys)
      ground_truth = _ground_truth(row, keys, regex)
      try:
        prompt, prompt_ids = _encode_prompt(tokenizer, messages, max_prompt_len, tools)
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
    extra_info = row.get("extra_info")
    row_prompt = _get(row, _prompt_key(row, keys))
    example = Example(prompt_ids, prompt, ground_truth, reward, row.get("data_source"),
                      dict(extra_info) if isinstance(extra_info, dict) else {}, f"{path}:{line}", messages=messages,
                      columns=row, row_prompt=row_prompt)
    why = rewards.cannot_score(reward, example.item(None))
    if why:
      raise rewards.Unscorable(f"{path}:{line}: {why}")
    examples.append(example)
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
  """(line or row number from 1, raw JSON line, or Parquet or `datasets` row)."""
  if os.path.isdir(path):
    try:
      import datasets  # pylint: disable=import-outside-toplevel  (the data extra)
    except ImportError:
      raise ValueError(f"{path}: a directory saved by Hugging Face datasets needs the datasets package: "
                       "pip install 'tlt_jax[data]'") from None
    try:
      data = datasets.load_from_disk(path)
    except Exception as e:  # pylint: disable=broad-exception-caught  (datasets raises what its readers do)
      raise ValueError(f"{path}: not a directory saved by datasets.save_to_disk: {type(e).__name__}: {e}") from e
    if isinstance(data, datasets.DatasetDict):
      raise ValueError(f"{path}: holds the splits {sorted(data)}: point at one of them ({path}/<split>)")
    yield from enumerate(data, start=1)
  elif path.endswith(".jsonl"):
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
    raise ValueError(f"{path}: unsupported dataset file type; expected .jsonl, .parquet or a directory saved by "
                     "datasets.save_to_disk")


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


def _get(row: dict[str, Any], key: str):
  """row[a][b] for the dotted key "a.b" (None where a level is missing)."""
  for part in key.split("."):
    row = row.get(part) if isinstance(row, dict) else None
  return row


def _check_keys(path: str, row: dict[str, Any], keys: Keys) -> None:
  """A configured key the file does not hold (its first row, every Parquet column) is an error."""
  for name in ("prompt_key", "answer_key"):
    key = getattr(keys, name)
    if key and key.split(".")[0] not in row:
      raise ValueError(f"{path}: no column {key.split('.')[0]!r} (data.{name}={key!r}); its columns: "
                       f"{', '.join(sorted(row))}")


def _prompt_key(row: dict[str, Any], keys: Keys) -> str | None:
  names = (keys.prompt_key,) if keys.prompt_key else _PROMPT_KEYS
  return next((k for k in names if _get(row, k) is not None), None)


def _messages(row: dict[str, Any], keys: Keys) -> Messages:
  key = _prompt_key(row, keys)
  if key is None:
    names = (keys.prompt_key,) if keys.prompt_key else _PROMPT_KEYS
    raise _Skip("missing_prompt", f"no {' / '.join(names)} field")
  prompt = _get(row, key)
  if isinstance(prompt, str):
    messages = [{"role": "user", "content": prompt}]
  elif isinstance(prompt, Sequence) and all(_is_message(m) for m in prompt):
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
  else:
    raise _Skip("bad_prompt", f"{key} is neither a string nor a list of {{role, content}}")
  if not any(m["content"].strip() for m in messages):
    raise _Skip("empty_prompt", f"{key} is empty")
  if keys.system_prompt and messages[0]["role"] != "system":
    messages = [{"role": "system", "content": keys.system_prompt}, *messages]
  return messages


def _is_message(message: Any) -> bool:
  return (isinstance(message, dict) and isinstance(message.get("role"), str)
          and isinstance(message.get("content"), str))


def _ground_truth(row: dict[str, Any], keys: Keys, regex: re.Pattern | None) -> str:
  names = (keys.answer_key,) if keys.answer_key else ("reward_model.ground_truth", *_GROUND_TRUTH_KEYS)
  value = next((_get(row, k) for k in names if _get(row, k) is not None), None)
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    if isinstance(value, float) and not math.isfinite(value):
      raise _Skip("bad_ground_truth", f"ground truth {value} is not a finite number")
    value = str(value)
  if value is None or (isinstance(value, str) and not value.strip()):
    raise _Skip("missing_ground_truth", f"no {' / '.join(names)} field")
  if not isinstance(value, str):
    raise _Skip("bad_ground_truth", f"ground truth is a {type(value).__name__}, not a string")
  found = regex.search(value) if regex is not None else None
  if found is not None:  # no match: a ground truth that is already bare (verl's)
    value = (found.group(1) if regex.groups else found.group(0)).strip()
  return value


def _encode_prompt(
    tokenizer: transformers.PreTrainedTokenizerBase, messages: Messages, max_prompt_len: int | None,
    tools: Sequence[dict] | None = None
) -> tuple[str, list[int]]:
  text = tokenizer_lib.chat_prompt(tokenizer, messages, tools)
  # The template already wrote the special tokens (BOS, role markers) as text.
  prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
  if max_prompt_len is not None and len(prompt_ids) > max_prompt_len:
    raise _Skip("prompt_too_long", f"{len(prompt_ids)} tokens > max_prompt_len {max_prompt_len}")
  return text, prompt_ids
