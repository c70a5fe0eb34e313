"""The TLT rollout's group threads with plain functions for the groups' work: the scheduler's turns
(idle groups train while others decode, the set of idle groups only grows), results and errors,
timeouts, and polling for the rounds of several processes."""

import threading

import pytest

from tlt_jax.rollout.groups import BUSY, IDLE, TRAINING, GroupRun


def _gated(groups):
  """A work function whose group g finishes when gates[g] is set; the gates."""
  gates = {g: threading.Event() for g in groups}
  def work(g):
    assert gates[g].wait(10)
    return f"samples of {g}"
  return work, gates


def _finish(run, gates, g):
  """Lets group g finish and waits until it is idle (a scheduler's turn waits for one group at most)."""
  gates[g].set()
  with run.lock:
    run.lock.wait_for(lambda: g in run.finished)


def test_idle_groups_train_while_others_decode_and_the_rollout_ends_when_the_last_one_does():
  work, gates = _gated([0, 1, 2])
  collected = []
  run = GroupRun([0, 1, 2], work, lambda g, out: collected.append((g, out)), timeout_s=10)
  gates[1].set()
  assert run.wait(lambda: True) == (False, (1,))
  assert run.claim((1,), lambda g: f"batch {g}") == {1: "batch 1"} and run.state == {0: BUSY, 1: TRAINING, 2: BUSY}
  _finish(run, gates, 2)
  assert run.wait(lambda: True) == (False, (1, 2))  # a training group stays in the set
  _finish(run, gates, 0)
  assert run.wait(lambda: True) == (True, (0, 1, 2))
  assert run.join() == {g: f"samples of {g}" for g in range(3)} and sorted(collected) == sorted(run.join().items())
  assert run.state[0] == IDLE and run.start <= min(run.finished.values())


def test_without_training_the_scheduler_waits_for_every_group():
  work, gates = _gated([0, 1])
  run = GroupRun([0, 1], work, lambda g, out: None, timeout_s=10)
  gates[0].set()
  waiter = threading.Thread(target=lambda: gates[1].set())
  waiter.start()
  assert run.wait(lambda: False) == (True, ())
  waiter.join()


def test_a_groups_error_is_raised_once_every_group_is_done():
  def work(g):
    if g == 1:
      raise ValueError("group 1 broke")
    return g
  run = GroupRun([0, 1], work, lambda g, out: None, timeout_s=10)
  assert run.wait(lambda: True)[0]
  with pytest.raises(ValueError, match="group 1 broke"):
    run.join()


def test_a_group_busy_past_the_timeout_is_an_error_not_a_hang():
  work, gates = _gated([0, 1])
  run = GroupRun([0, 1], work, lambda g, out: None, timeout_s=0.05)
  gates[0].set()
  with pytest.raises(TimeoutError, match=r"rollout groups \[1\] did not finish within timeout_s=0.05"):
    run.wait(lambda: False)
  gates[1].set()
  run.join()


def test_polling_returns_while_every_group_is_busy():
  """Several processes: a process whose groups all decode still joins each round."""
  work, gates = _gated([2])
  run = GroupRun([2], work, lambda g, out: None, timeout_s=10, poll_s=0.01)
  assert run.wait(lambda: True) == (False, ())
  assert run.claim((0, 1), lambda g: g) == {}  # other processes' groups train there
  gates[2].set()
  assert run.join() == {2: "samples of 2"}
