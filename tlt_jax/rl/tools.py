"""Tool calls in multi-turn rollouts: the host's side of `tlt_jax.rollout.tools.Turns`.

`rollout.tools` names the functions the model may call, as rewards are named (tlt_jax.rl.rewards): a built-in
("calculator": `calculator`), "path/to/file.py:function" or "package.module:function". Each is a plain function
with type hints and a Google-style docstring: transformers builds its JSON schema from them (`get_json_schema`,
what `apply_chat_template(tools=[fn])` does), and the chat template puts the schemas into the prompt
(`tokenizer.chat_prompt`). A function transformers cannot describe is an error at start-up naming it.

Calls are read in the Hermes format, the one Qwen2.5's, Qwen3's and the tiny world's templates use: every
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the turn's text ("arguments" may be a JSON string
holding the object; a last call left unclosed is read too, as vLLM's Hermes parser reads it). No other format is
parsed: Llama 3's bare JSON calls, Mistral's [TOOL_CALLS] and the like are plain text, a turn without a call. A
call that is not valid JSON, names no tool or an unknown one, or passes arguments the function does not take is
answered with an error message to the model, never an exception.

Each call runs in a worker process under `timeout_s` (tlt_jax.rl.scorer's `Worker`: spawned, deaf to SIGINT and
SIGTERM, dead with its parent; a hung one is killed and replaced), driven by one thread of a small pool, so that
`submit` returns at once while the engine decodes. `workers=0` runs them in this process, each in a thread of its
own, waited for `timeout_s` (a hung call's thread is left running, not killed: use workers for tools that hang). The
model gets a call's return value as text: a string as it is, a number or bool by str(), a dict or list as JSON;
anything else, an exception ("Error: <Type>: <message>") or a timeout is an error message. A text longer than
`max_tokens` tokens keeps its first and last halves around a note of how many tokens were cut (verl's "middle"
truncation, counted in tokens: they are what a response's budget counts); the call's record says how long it was.

What a turn appends is what the chat template renders after the model's content: the assistant turn's end
without its first token (the stop token the model emitted), a tool message per call (role "tool") and the next
assistant turn's opening. Start-up checks on a probe that the template renders tool messages and ends an
assistant turn with a special token right after its content.
"""

from __future__ import annotations

import ast
import concurrent.futures
import fractions
import functools
import inspect
import json
import math
import multiprocessing.util
import numbers
import operator
import queue
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import transformers

from tlt_jax.rl import rewards, scorer
from tlt_jax.rl import tokenizer as tokenizer_lib
from tlt_jax.rollout import tools as turns_lib

_SENTINEL = "TLT_TOOL_TURN_CONTENT"  # the model's content in the probe's rendering
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class ToolError(ValueError):
  """A tool cannot be loaded or described, or the chat template cannot render tool turns."""


# ---- the built-in ----

_MAX_EXPRESSION = 1000  # characters
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
  """Evaluates an arithmetic expression exactly.

  Args:
    expression: Integers and decimals with + - * / and parentheses, e.g. "(12.5 - 3) * -4 / 5".
  """
  if len(expression) > _MAX_EXPRESSION:
    raise ValueError(f"the expression is longer than {_MAX_EXPRESSION} characters")
  try:
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
  except SyntaxError as e:
    raise ValueError(f"{expression!r} is not an arithmetic expression ({e.msg})") from None
  except RecursionError:
    raise ValueError("the expression is nested too deeply") from None
  if value.denominator == 1 and abs(value) < 10**16:
    return str(value.numerator)
  try:
    return repr(float(value))
  except OverflowError:
    raise ValueError("the result is too large") from None


def _evaluate(node: ast.AST) -> fractions.Fraction:
  """`node`'s value, exact (0.1 + 0.2 is 0.3); a ValueError for anything but numbers, + - * / and parentheses."""
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    if not math.isfinite(node.value):
      raise ValueError("a number in the expression is too large")
    return fractions.Fraction(repr(node.value))  # the decimal as written, not its binary float
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Div) and right == 0:
      raise ValueError("division by zero")
    return _BINARY[type(node.op)](left, right)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_evaluate(node.operand))
  raise ValueError(f"{ast.unparse(node)!r} is not allowed: only numbers, + - * / and parentheses")


TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}


# ---- loading, schemas, prompts ----

@functools.cache
def load(spec: str) -> Callable[..., Any]:
  """The function `spec` names (module docstring); a ToolError says why it cannot be loaded."""
  return rewards.import_function(spec, "tool", TOOLS, ToolError)


def schema(spec: str) -> dict[str, Any]:
  """The JSON schema of the function `spec` names, as transformers builds it; a ToolError names the spec."""
  fn = load(spec)
  try:
    inspect.signature(fn)
    return transformers.utils.get_json_schema(fn)
  except Exception as e:  # pylint: disable=broad-exception-caught  (transformers' own exceptions, or a builtin's)
    raise ToolError(f"tool {spec!r}: transformers cannot describe it ({type(e).__name__}: {e}); a tool is a function "
                    "with type hints and a Google-style docstring with an Args section") from None


def trajectory(sample) -> dict[str, Any]:
  """What a reward gets in `extra_info` of a multi-turn response (a rollout `Sample`), whose last turn is
  the `solution_str` it scores: its "turns" and "tool_calls" (their records); {} for a response of a
  rollout without tools."""
  return {} if sample.tool_mask is None else {"turns": sample.turns, "tool_calls": sample.tool_calls}


def conversation(sample, tokenizer) -> list[dict[str, Any]] | None:
  """What TRL's GRPOTrainer passes a reward as a multi-turn response's completion: each assistant turn (its text
  without the tool-call blocks, and its calls as "tool_calls") followed by a "tool" message per call with the
  result the model read; None for a response of a rollout without tools."""
  if sample.tool_mask is None:
    return None
  messages, calls = [], iter(sample.tool_calls)
  own = ~np.asarray(sample.tool_mask, bool)
  starts = np.flatnonzero(own & ~np.concatenate([[False], own[:-1]]))
  ends = np.flatnonzero(own & ~np.concatenate([own[1:], [False]])) + 1
  for a, b in zip(starts, ends):
    ids = sample.tokens[a:b].tolist()
    made = [next(calls, None) for _ in _CALL.finditer(tokenizer.decode(ids, skip_special_tokens=False))]
    turn = {"role": "assistant", "content": _CALL.sub("", tokenizer.decode(ids, skip_special_tokens=True)).strip()}
    if made:
      turn["tool_calls"] = [{"type": "function", "function": {"name": r["name"], "arguments": r["arguments"]}}
                            for r in made if r is not None]
    messages.append(turn)
    messages += [{"role": "tool", "name": r["name"], "content": r["result"]} for r in made if r is not None]
  return messages


def stats(samples) -> dict[str, float]:
  """A step's tool metrics: calls and turns per response, the share of calls that failed, the share of
  the response tokens tools appended; {} without tools."""
  if not samples or samples[0].tool_mask is None:
    return {}
  calls = [c for s in samples for c in s.tool_calls]
  appended, tokens = sum(int(s.tool_mask.sum()) for s in samples), sum(len(s.tokens) for s in samples)
  return {"tools/calls_per_response": len(calls) / len(samples),
          "tools/turns_per_response": float(np.mean([s.turns for s in samples])),
          "tools/token_share": appended / max(tokens, 1),
          "tools/errors": sum(c["error"] is not None for c in calls) / max(len(calls), 1)}


def call_text(name: str, arguments: dict[str, Any]) -> str:
  """A call as a model writes it in the Hermes format (what `submit` parses; SFT targets)."""
  return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# ---- running a call (in a worker process) ----

def _load(spec: str) -> str | None:
  """In a worker: imports the tool `spec` names; why it cannot (None: it can)."""
  try:
    load(spec)
    return None
  except ToolError as e:
    return str(e)


def _run(spec: str, arguments: dict[str, Any]) -> tuple[str | None, str, float]:
  """Calls the tool: (the error's kind or None, the text the model gets, seconds)."""
  start = time.monotonic()
  try:
    value = load(spec)(**arguments)
  except Exception as e:  # pylint: disable=broad-exception-caught  (a tool's failure is the model's to read)
    return "raised", f"Error: {type(e).__name__}: {e}", time.monotonic() - start
  seconds = time.monotonic() - start
  if isinstance(value, str):
    return None, value, seconds
  if isinstance(value, (bool, numbers.Number)):
    return None, str(value), seconds
  if isinstance(value, (dict, list, tuple)):
    try:
      return None, json.dumps(value, ensure_ascii=False), seconds
    except (TypeError, ValueError) as e:
      return "bad_result", f"Error: the tool's result cannot be written as JSON ({e})", seconds
  return "bad_result", f"Error: the tool returned a {type(value).__name__}, not text, a number or JSON", seconds


def _failed(record: dict[str, Any], kind: str, message: str) -> dict[str, Any]:
  record.update(error=kind, result=message)
  return record


# ---- the host's side of tool turns ----

class ToolTurns(turns_lib.Turns):
  """Runs the tool calls of assistant turns and renders what they append (module docstring).

  `schemas`: the tools' JSON schemas, for the prompts (`tokenizer.chat_prompt`); `stop_token_id`: the token that ends an
  assistant turn in the chat template, which `submit` expects last in a turn."""

  def __init__(self, specs: Sequence[str], tokenizer: transformers.PreTrainedTokenizerBase, *, max_turns: int,
               timeout_s: float, workers: int, max_tokens: int | None = None):
    specs = (specs,) if isinstance(specs, str) else tuple(specs)
    if not specs:
      raise ToolError("no tools named")
    if max_turns < 1 or timeout_s <= 0 or workers < 0 or (max_tokens is not None and max_tokens < 2):
      raise ToolError(f"max_turns={max_turns} (at least 1), timeout_s={timeout_s} (positive), workers={workers} "
                      f"(0: in this process), max_tokens={max_tokens} (at least 2, or None: no limit)")
    self.tokenizer, self.max_turns, self.timeout_s, self.max_tokens = tokenizer, max_turns, timeout_s, max_tokens
    self.schemas = [schema(spec) for spec in specs]
    self._specs: dict[str, str] = {}  # a tool's name -> its spec
    for spec, s in zip(specs, self.schemas):
      name = s["function"]["name"]
      if name in self._specs:
        raise ToolError(f"tools {self._specs[name]!r} and {spec!r} are both named {name!r}")
      self._specs[name] = spec
    self._tokenizer_lock = threading.Lock()  # the pool's threads render while `submit` decodes
    self.stop_token_id = self._probe()
    self._workers: list[scorer.Worker] = []
    self._idle: queue.SimpleQueue[scorer.Worker] = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tool") if workers else None
    # Killed when collected or at exit, before multiprocessing's clean-up (scorer.Scorer's reason).
    multiprocessing.util.Finalize(self, scorer.kill_all, args=(self._workers,), exitpriority=100)

  # ---- rendering ----

  def _tail(self, messages: list[tuple[str, str]]) -> list[int]:
    """The tokens the template renders after an assistant turn's content when (name, content) tool messages
    follow it, up to the next assistant turn's opening; a ChatTemplateError names the tokenizer."""
    conversation = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
    conversation += [{"role": "tool", "name": name, "content": content} for name, content in messages]
    with self._tokenizer_lock:
      text = tokenizer_lib.chat_prompt(self.tokenizer, conversation, self.schemas)
      at = text.find(_SENTINEL)
      if at < 0:
        raise ToolError(f"{tokenizer_lib.describe(self.tokenizer)}: its chat template does not render an assistant "
                        "message's content as it is")
      return self.tokenizer(text[at + len(_SENTINEL):], add_special_tokens=False).input_ids

  def _cut(self, record: dict[str, Any]) -> dict[str, Any]:
    """The record with its result cut to `max_tokens` tokens (module docstring), and "result_tokens" its length."""
    if self.max_tokens is None:
      return record
    with self._tokenizer_lock:
      ids = self.tokenizer(record["result"], add_special_tokens=False).input_ids
      record["result_tokens"] = len(ids)
      if len(ids) > self.max_tokens:
        head, tail = self.max_tokens // 2, self.max_tokens - self.max_tokens // 2
        record["result"] = (f"{self.tokenizer.decode(ids[:head])}\n...({len(ids) - self.max_tokens} tokens cut)...\n"
                            f"{self.tokenizer.decode(ids[len(ids) - tail:])}")
    return record

  def _probe(self) -> int:
    """The stop token: the special token the template renders right after an assistant turn's content."""
    name = tokenizer_lib.describe(self.tokenizer)
    try:
      tail = self._tail([(next(iter(self._specs)), "probe")])
    except tokenizer_lib.ChatTemplateError as e:
      raise ToolError(f"tool turns cannot be rendered: {e}") from None
    special = set(self.tokenizer.all_special_ids) | {i for i, t in self.tokenizer.added_tokens_decoder.items()
                                                     if t.special}
    if not tail or tail[0] not in special:
      raise ToolError(f"{name}: its chat template does not end an assistant turn with a special token right after "
                      f"the content (it renders {self.tokenizer.decode(tail[:20])!r}), so a model's stop token is not "
                      "where the template ends its turn")
    return tail[0]

  # ---- turns ----

  def submit(self, turn: np.ndarray) -> concurrent.futures.Future | None:
    """Starts the tool calls of an assistant turn (its tokens, the stop token last); None when it calls none."""
    turn = np.asarray(turn).reshape(-1)
    if not turn.size or int(turn[-1]) != self.stop_token_id:  # another stop token (e.g. end of text) ends the row
      return None
    with self._tokenizer_lock:
      text = self.tokenizer.decode(turn[:-1].tolist(), skip_special_tokens=False)
    records = [self._parse(m.group(1) if m.group(1) is not None else m.group(2)) for m in _CALL.finditer(text)]
    if not records:
      return None
    return self._gather([self._start(r) for r in records])

  def _parse(self, call: str) -> dict[str, Any]:
    """A call's record: its name and arguments, or the error the model gets for them."""
    record = {"name": None, "arguments": None, "result": None, "error": None, "seconds": 0.0}
    try:
      call = json.loads(call)
    except json.JSONDecodeError as e:
      return _failed(record, "bad_json", f"Error: the tool call is not valid JSON ({e})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
      return _failed(record, "bad_json", 'Error: a tool call is a JSON object with a "name" and "arguments"')
    record["name"] = name = call["name"]
    record["arguments"] = arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # a JSON string holding the object
      try:
        record["arguments"] = arguments = json.loads(arguments)
      except json.JSONDecodeError:
        pass
    if name not in self._specs:
      return _failed(record, "unknown_tool", f"Error: unknown tool {name!r}; the tools are {', '.join(self._specs)}")
    if not isinstance(arguments, dict):
      return _failed(record, "bad_arguments", f'Error: the "arguments" of a call to {name} must be a JSON object')
    try:
      inspect.signature(load(self._specs[name])).bind(**arguments)
    except TypeError as e:
      return _failed(record, "bad_arguments", f"Error: bad arguments for {name}: {e}")
    return record

  def _start(self, record: dict[str, Any]) -> concurrent.futures.Future:
    """A future of the call's record once it has run (at once for a malformed call, or with workers=0)."""
    if self._pool is not None and not record["error"]:
      return self._pool.submit(self._call, record)
    done = concurrent.futures.Future()
    done.set_result(record if record["error"] else self._call(record))
    return done

  def _call(self, record: dict[str, Any]) -> dict[str, Any]:
    spec, arguments = self._specs[record["name"]], record["arguments"]
    kind, text, seconds = self._in_thread(spec, arguments) if self._pool is None else self._in_worker(spec, arguments)
    record.update(error=kind, result=text, seconds=seconds)
    return record

  def _in_thread(self, spec: str, arguments: dict[str, Any]) -> tuple[str | None, str, float]:
    """`_run` in this process, in a daemon thread waited for up to the timeout (then left to itself)."""
    answer = []
    thread = threading.Thread(target=lambda: answer.append(_run(spec, arguments)), daemon=True, name="tool")
    thread.start()
    thread.join(self.timeout_s)
    if not answer:
      return "timeout", f"Error: the call timed out after {self.timeout_s:g} s", self.timeout_s
    return answer[0]

  def _in_worker(self, spec: str, arguments: dict[str, Any]) -> tuple[str | None, str, float]:
    """`_run` in an idle worker process (a new one when none is), under the timeout."""
    try:
      worker = self._idle.get_nowait()
    except queue.Empty:
      worker = scorer.Worker()
      with self._lock:
        self._workers.append(worker)
    loading = spec not in worker.loaded
    try:
      if loading:  # a worker's start and its imports take seconds: not the call's time
        load_s = max(120.0, 10 * self.timeout_s)
        why = worker.call((_load, spec), load_s)
        if why:
          self._idle.put(worker)
          return "raised", f"Error: {why}", 0.0
        worker.loaded.add(spec)
        loading = False
      answer = worker.call((_run, spec, arguments), self.timeout_s)
    except TimeoutError:
      self._drop(worker)
      if loading:
        return "timeout", f"Error: the tool's worker process did not start in {load_s:g} s", load_s
      return "timeout", f"Error: the call timed out after {self.timeout_s:g} s", self.timeout_s
    except (EOFError, OSError):  # a tool that ended the interpreter, or a kill from outside
      why = worker.died()
      self._drop(worker)
      return "raised", f"Error: the tool's {why}", 0.0
    self._idle.put(worker)
    return answer

  def _drop(self, worker: scorer.Worker) -> None:
    worker.kill()
    with self._lock:
      if worker in self._workers:
        self._workers.remove(worker)

  def _gather(self, calls: list[concurrent.futures.Future]) -> concurrent.futures.Future:
    """A future of the `Turn` once every call is done."""
    turn = concurrent.futures.Future()
    left, lock = [len(calls)], threading.Lock()

    def one_done(_):
      with lock:
        left[0] -= 1
        if left[0]:
          return
      try:
        turn.set_result(self.turn([c.result() for c in calls]))
      except BaseException as e:  # pylint: disable=broad-exception-caught  (close() cancelled them; or a bug)
        turn.set_exception(e)  # for the engine to see, rather than wait forever

    for c in calls:
      c.add_done_callback(one_done)
    return turn

  def turn(self, records: list[dict[str, Any]]) -> turns_lib.Turn:
    """What the calls `records` (each with its "name" and "result") append to the turn that made them."""
    records = [self._cut(r) for r in records]
    tokens = self._tail([(r["name"] or "", r["result"]) for r in records])
    if tokens[:1] != [self.stop_token_id]:
      raise ToolError(f"{tokenizer_lib.describe(self.tokenizer)}: its chat template ends an assistant turn followed "
                      "by these tool messages with another token than the probe's")
    return turns_lib.Turn(np.asarray(tokens[1:], np.int32), records)

  def close(self) -> None:
    """Cancels the calls not started and stops the workers (calls under way get an error)."""
    if self._pool is not None:
      self._pool.shutdown(wait=False, cancel_futures=True)
    with self._lock:
      scorer.kill_all(self._workers)
