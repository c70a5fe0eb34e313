"""Scores batches of responses with a run's reward functions (tlt_jax.rl.rewards), in worker processes.

Each call runs under a timeout in a worker process of its own (spawned: rewards never share the trainer's
threads): a per-response function's once per response, a batch function's (TRL's, verl's batch) once per
batch. A call that raises or times out scores 0 and is counted (`reward/failures`, `reward/timeouts`);
the first few are logged with the sample's index and row; a hung worker is killed and replaced. More failed
calls than `max_failures` of them (`data.reward_max_failures`), or all of them, stop the run: a RewardError
names the reward and the first exception, since a step whose rewards failed has no signal to learn from.
A value that is not a score (not a finite number, a dict without "score", None outside TRL's convention, a
batch of the wrong length) is a RewardError naming the row: a bug in the reward, not a hard sample.

Several functions are summed with their weights, each function's values that are None (TRL's "does not
apply") left out; each function's mean is logged as `reward/<name>`.

The workers ignore SIGINT and SIGTERM: a Ctrl-C or a scheduler's SIGTERM to the whole process group
reaches the trainer, which finishes its step and stops them (SIGKILL, which nothing can block or leave
half-done). On Linux a worker also dies with the trainer. `workers=0` scores in this process, no timeout.
`Worker` (a process that runs `(function, *args)` tasks) runs tlt_jax.rl.tools's tool calls too.
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import numbers
import signal
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from tlt_jax.rl import rewards

_LOGGED = 3  # failures and timeouts logged per batch; the rest are counted
_PR_SET_PDEATHSIG = 1


def _serve(conn: multiprocessing.connection.Connection) -> None:
  """A worker: `(function, *args)` in, `function(*args)` out, until the parent closes the pipe."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  if sys.platform == "linux":  # die with the parent, however it ends
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  while True:
    try:
      function, *args = conn.recv()
    except EOFError:  # the parent is gone
      return
    conn.send(function(*args))


class Worker:
  """A spawned process that runs `(function, *args)` tasks, one at a time: `function` is a module-level function
  (pickled by name), that returns what can be pickled and never raises. It ignores SIGINT and SIGTERM (module
  docstring); `kill` stops it."""

  def __init__(self):
    self.conn, child = multiprocessing.Pipe()
    self.process = multiprocessing.get_context("spawn").Process(target=_serve, args=(child,), daemon=True)
    self.process.start()
    child.close()
    self.loaded: set[str] = set()  # the specs it has imported
    self.job: tuple[Any, float] | None = None  # (what the task is to its caller, its deadline)

  def send(self, task: tuple, job: Any, timeout_s: float) -> None:
    """Starts `task`; its answer is read from `conn`, due within `timeout_s`."""
    self.conn.send(task)
    self.job = (job, time.monotonic() + timeout_s)

  def call(self, task: tuple, timeout_s: float) -> Any:
    """`task`'s answer; a TimeoutError when there is none in `timeout_s` (then kill the worker), an EOFError or
    OSError when the process died."""
    self.conn.send(task)
    if not self.conn.poll(timeout_s):
      raise TimeoutError(f"no answer in {timeout_s:g} s")
    return self.conn.recv()

  def died(self) -> str:
    """Why an answer is missing once the pipe has closed, with the exit code."""
    self.process.join(timeout=5)
    return f"worker process died (exit code {self.process.exitcode})"

  def kill(self) -> None:
    self.process.kill()
    self.process.join()
    self.conn.close()


def kill_all(workers: list[Worker]) -> None:
  """Kills `workers` and empties the list."""
  for w in workers:
    w.kill()
  workers.clear()


def _load(spec: str) -> tuple[str, Any, dict, dict]:
  """In a worker: imports the reward `spec` names, as `rewards.call` answers."""
  try:
    rewards.signature(spec)
    return "ok", None, {}, {}
  except rewards.RewardError as e:
    return "error", str(e), {}, {}


def _number(value: Any) -> float | None:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    return None
  value = float(value)
  return value if math.isfinite(value) else None


class Scorer:
  """Scores batches of responses with a run's rewards (module docstring)."""

  def __init__(self, workers: int = 4, timeout_s: float = 60.0, max_failures: float = 0.1):
    self.workers, self.timeout_s, self.max_failures = workers, timeout_s, max_failures
    self._workers: list[Worker] = []
    # Killed when the scorer is collected or the interpreter exits, before multiprocessing's own clean-up
    # (which would SIGTERM them, ignored, and wait): the finalizers of positive priority run first.
    multiprocessing.util.Finalize(self, kill_all, args=(self._workers,), exitpriority=100)

  # ---- running calls ----

  def _run(self, tasks: list[tuple[str, list[rewards.Item], rewards.TrainerState | None]]) -> list[tuple]:
    """Each task's `rewards.call` result, or ("timeout", why, {}, {}), in the workers."""
    if not self.workers:
      return [rewards.call(*task) for task in tasks]
    while len(self._workers) < self.workers:
      self._workers.append(Worker())
    # A worker's start and its imports take seconds: not a call's time.
    load_s = max(120.0, 10 * self.timeout_s)
    results: list[tuple | None] = [None] * len(tasks)
    pending = deque(range(len(tasks)))
    try:
      self._serve_all(tasks, pending, results, load_s)
    except BaseException:  # a reward that cannot load, a Ctrl-C: no answer may be left in a worker's pipe
      for w in list(self._workers):
        if w.job:
          self._replace(w)
      raise
    return results

  def _serve_all(self, tasks, pending: deque, results: list, load_s: float) -> None:
    """Hands `pending` tasks to idle workers (a spec's first to a worker loads it) until all are answered."""
    while pending or any(w.job for w in self._workers):
      for w in self._workers:
        if w.job is None and pending:
          spec = tasks[pending[0]][0]
          if spec in w.loaded:
            w.send((rewards.call, *tasks[pending[0]]), pending.popleft(), self.timeout_s)
          else:
            w.send((_load, spec), spec, load_s)
      busy = {w.conn: w for w in self._workers if w.job}
      deadline = min(w.job[1] for w in busy.values())
      for conn in multiprocessing.connection.wait(list(busy), timeout=max(0.0, deadline - time.monotonic())):
        w = busy[conn]
        job, _ = w.job
        w.job = None
        try:
          result = conn.recv()
        except (EOFError, OSError):  # it died: a reward that crashed the interpreter, or a kill from outside
          result = ("error", f"the reward's {w.died()}", {}, {})
          self._replace(w)
        if isinstance(job, str):  # loaded a spec
          if result[0] != "ok":
            raise rewards.RewardError(f"reward {job!r}: {result[1]}")
          w.loaded.add(job)
        else:
          results[job] = result
      for w in self._workers:
        if w.job and time.monotonic() > w.job[1]:
          job, _ = w.job
          self._replace(w)
          if isinstance(job, str):
            raise rewards.RewardError(f"reward {job!r}: its worker process did not start in {load_s:g} s")
          results[job] = ("timeout", f"no result in {self.timeout_s:g} s", {}, {})

  def _replace(self, worker: Worker) -> None:
    worker.kill()
    self._workers[self._workers.index(worker)] = Worker()

  # ---- scoring ----

  def score(self, reward: str | Sequence[str] | rewards.Reward, items: Sequence[rewards.Item], *, what: str = "",
            state: rewards.TrainerState | None = None,
            columns: dict[str, list] | None = None,
            per_function: list | None = None) -> tuple[np.ndarray, dict[str, float]]:
    """(scores [N], stats): the mean, `failures` and `timeouts` (calls that raised or timed out, each
    scoring 0), each function's mean when there are several, and the mean of every other numeric key the
    functions return in dicts or log. `what` (e.g. "in step 3") goes into errors. `columns` gets what TRL
    functions log with `log_extra`: a list of N per column (None where a call logged none); `per_function`
    gets (each function's values [K, N], NaN where it returned None; their weights [K])."""
    reward = rewards.check(reward)
    n, k = len(items), len(reward.specs)
    calls = []  # (function, the samples it scores)
    for f, spec in enumerate(reward.specs):
      chunks = [list(range(n))] if rewards.signature(spec).batched else [[i] for i in range(n)]
      calls += [(f, chunk) for chunk in chunks if chunk]
    results = self._run([(reward.specs[f], [items[i] for i in chunk], state) for f, chunk in calls])
    values = np.zeros((k, n), np.float64)  # NaN: does not apply (None, TRL's convention)
    failed: list[tuple[int, int, str, str]] = []  # (function, sample, kind, why)
    extras: dict[str, list[float]] = {}
    for (f, chunk), (kind, value, logged, logged_columns) in zip(calls, results):
      spec = reward.specs[f]
      if columns is not None:
        for name, column in logged_columns.items():
          row = columns.setdefault(name, [None] * n)
          for i, x in zip(chunk, column):
            row[i] = x
      if kind != "ok":
        failed += [(f, i, kind, value) for i in chunk]
        continue
      if not isinstance(value, (list, tuple)) or len(value) != len(chunk):  # a batch function's
        got = f"{len(value)} values" if isinstance(value, (list, tuple)) else repr(value)[:80]
        raise rewards.RewardError(f"reward {spec!r} returned {got} for a batch of {len(chunk)}: a batch "
                                  "function returns one value per response")
      for i, v in zip(chunk, value):
        values[f, i] = self._value(spec, v, items[i], i, extras)
      for key, x in logged.items():
        extras.setdefault(key, []).append(x)
    self._check_failures(reward, items, failed, what)
    weights = np.asarray(reward.weights)[:, None]
    if per_function is not None:
      per_function.append((values, weights[:, 0]))
    scores = np.nansum(weights * values, axis=0).astype(np.float32)
    unscored = np.isnan(values).all(axis=0)
    scores[unscored] = np.nan  # TRL's: out of the logged mean and the group's baseline, advantage 0
    if unscored.any():
      logging.warning("reward %s: no function applies to %d of %d samples (each returned None); they score NaN, as "
                      "in TRL: left out of the mean and their group's baseline, advantage 0", reward, unscored.sum(), n)
    scored = scores[~unscored]
    stats = {"mean": float(scored.mean()) if len(scored) else math.nan if n else 0.0,  # NaN: none scorable
             "failures": float(sum(kind == "error" for *_, kind, _ in failed)),
             "timeouts": float(sum(kind == "timeout" for *_, kind, _ in failed))}
    if k > 1:
      for name, row in zip(reward.names(), values):
        stats[name] = float(np.nanmean(row)) if not np.isnan(row).all() else math.nan
    stats.update({key: float(np.mean(x)) for key, x in extras.items() if key not in stats})
    return scores, stats

  @staticmethod
  def _value(spec: str, value: Any, item: rewards.Item, i: int, extras: dict[str, list[float]]) -> float:
    """One call's value as a score (NaN: TRL's None), its dict's other numeric keys into `extras`."""
    if value is None and rewards.signature(spec).convention == "trl":
      return math.nan
    score = value.get("score") if isinstance(value, Mapping) else value
    if _number(score) is None:
      got = "a dict without 'score'" if isinstance(value, Mapping) and "score" not in value else repr(score)[:80]
      raise rewards.RewardError(f"reward {spec!r} returned {got} for sample {i} ({item.where or 'no source'}): a "
                                "reward must return a finite number or a dict with a 'score'"
                                + (" (or None where it does not apply)" if rewards.signature(spec).batched else ""))
    if isinstance(value, Mapping):
      for key, x in value.items():
        if key != "score" and _number(x) is not None:
          extras.setdefault(key, []).append(float(x))
    return float(score)

  def _check_failures(self, reward: rewards.Reward, items: Sequence[rewards.Item],
                      failed: list[tuple[int, int, str, str]], what: str) -> None:
    """Logs the first failures; more than `max_failures` of the calls, or all, is a RewardError."""
    for f, i, kind, why in failed[:_LOGGED]:
      logging.warning("reward %r %s on sample %d (%s): %s; scored 0", reward.specs[f],
                      "failed" if kind == "error" else "timed out", i, items[i].where or "no source", why)
    total = len(items) * len(reward.specs)
    if len(failed) > _LOGGED:
      logging.warning("reward %s: %d of %d calls failed, %d timed out", reward, sum(x[2] == "error" for x in failed),
                      total, sum(x[2] == "timeout" for x in failed))
    if failed and (len(failed) == total or len(failed) > self.max_failures * total):
      f, i, kind, why = failed[0]
      share = "all" if len(failed) == total else f"more than data.reward_max_failures={self.max_failures:g} of them"
      raise rewards.RewardError(
          f"reward {reward.specs[f]!r} failed on {len(failed)} of {total} samples{' ' + what if what else ''} "
          f"({share}), so no update could learn from them; the first, sample {i} ({items[i].where or 'no source'}): "
          f"{'timed out, ' if kind == 'timeout' else ''}{why}")

  def close(self) -> None:
    """Stops the workers (at once: they hold nothing that a kill could leave half-done)."""
    kill_all(self._workers)
