"""The host threads of one TLT rollout: one per device group, and the scheduler's view of them.

Each group's thread runs its share of the rollout (`work(g)`), hands the result over
(`collect(g, result)`, under the lock the scheduler holds while it reads the drafter's buffer) and
goes from BUSY to IDLE; the scheduler marks the idle groups it trains with TRAINING. `wait` is
the scheduler's turn: it returns once every group is done or, while some decode, once some are
not busy and the drafter can train, with the groups not busy (a set that only grows). Nothing
here knows the engine or the drafter (tlt_jax/rollout/tlt.py passes them in), so the schedule is
tested with plain functions.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

BUSY, IDLE, TRAINING = "busy", "idle", "training"


class GroupRun:
  """Starts a thread per group at construction; `wait`, `claim` and `join` are the scheduler's."""

  def __init__(self, groups: Sequence[int], work: Callable[[int], Any], collect: Callable[[int, Any], None],
               timeout_s: float, poll_s: float | None = None):
    """
    Args:
      groups: the groups this process runs.
      work: a group's share of the rollout; its result goes to `collect` and `join`.
      collect: takes a group's result under the lock (e.g. into the drafter's buffer).
      timeout_s: a group still busy by then is an error, not a hang.
      poll_s: None: `wait` blocks until it has something to return; else it returns at least this
        often (several processes: a process with only busy groups joins every round).
    """
    self.groups, self.state = list(groups), {g: BUSY for g in groups}
    self.results: dict[int, Any] = {}
    self.finished: dict[int, float] = {}  # perf_counter time each group went idle
    self._errors: dict[int, BaseException] = {}
    self._work, self._collect, self._poll_s = work, collect, poll_s
    self.lock = threading.Condition()
    self.start = time.perf_counter()
    self.timeout_s, self.deadline = timeout_s, self.start + timeout_s
    self._threads = [threading.Thread(target=self._run, args=(g,), name=f"rollout-group-{g}", daemon=True)
                     for g in self.groups]
    for t in self._threads:
      t.start()

  def _run(self, g: int) -> None:
    try:
      result = self._work(g)
      with self.lock:
        self._collect(g, result)
        self.results[g] = result
    except BaseException as e:  # re-raised by `join`
      self._errors[g] = e
    with self.lock:
      self.finished[g] = time.perf_counter()
      self.state[g] = IDLE
      self.lock.notify_all()

  def busy(self) -> list[int]:
    return [g for g in self.groups if self.state[g] == BUSY]

  def left_s(self) -> float:
    return max(self.deadline - time.perf_counter(), 0.0)

  def wait(self, trains: Callable[[], bool]) -> tuple[bool, tuple[int, ...]]:
    """The scheduler's turn: (every group done; the groups not busy when `trains()`, else ()).

    Raises:
      TimeoutError: a group is still busy at the deadline.
    """
    with self.lock:
      ready = lambda: not self.busy() or (len(self.busy()) < len(self.groups) and trains())
      left = self.left_s()
      waited = self.lock.wait_for(ready, timeout=left if self._poll_s is None else min(left, self._poll_s))
      if (not waited and self._poll_s is None) or (self.busy() and time.perf_counter() > self.deadline):
        raise TimeoutError(f"rollout groups {self.busy()} did not finish within timeout_s={self.timeout_s}")
      idle = tuple(g for g in self.groups if self.state[g] != BUSY) if trains() else ()
      return not self.busy(), idle

  def claim(self, idle: Sequence[int], batch: Callable[[int], Any]) -> dict[int, Any]:
    """Marks this process's groups of `idle` TRAINING and builds each one's `batch(g)` under the lock."""
    with self.lock:
      mine = [g for g in idle if g in self.state]
      for g in mine:
        self.state[g] = TRAINING
      return {g: batch(g) for g in mine}

  def join(self) -> dict[int, Any]:
    """Waits for every thread; re-raises the first group's error; the results by group."""
    for t in self._threads:
      t.join()
    for g in self.groups:
      if g in self._errors:
        raise self._errors[g]
    return self.results
