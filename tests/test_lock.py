"""Tests for tlt_jax/lock.py: one holder per workdir, named to whoever is refused; released when the holder
ends however it ends (a SIGKILL included), so a lock file left by a dead run is taken over."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from tlt_jax import lock


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
  held = lock.WorkdirLock(str(tmp_path / "run"))
  try:
    with pytest.raises(lock.InUse, match=rf"run is in use by another run \(pid {os.getpid()} on "
                                         rf"{socket.gethostname()}, started .* UTC: "):
      lock.WorkdirLock(str(tmp_path / "run"))
  finally:
    held.release()
  lock.WorkdirLock(str(tmp_path / "run")).release()  # released: taken again


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path):
  """A SIGKILLed holder leaves its file, with its record, but no lock."""
  workdir = tmp_path / "run"
  holder = subprocess.Popen([sys.executable, "-c", f"from tlt_jax import lock; lock.WorkdirLock({str(workdir)!r}); "
                             "print('held', flush=True); import time; time.sleep(600)"], stdout=subprocess.PIPE,
                            text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(lock.InUse, match=f"pid {holder.pid} "):
      lock.WorkdirLock(str(workdir))
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  assert json.loads((workdir / lock.NAME).read_text())["pid"] == holder.pid  # stale, yet no lock
  taken = lock.WorkdirLock(str(workdir))
  assert json.loads((workdir / lock.NAME).read_text())["pid"] == os.getpid()
  taken.release()


def test_a_run_that_wrote_nothing_leaves_nothing(tmp_path):
  """Released with the workdir holding only its file, the lock removes it and the directories it made."""
  held = lock.WorkdirLock(str(tmp_path / "runs" / "new"))
  held.release()
  assert os.listdir(tmp_path) == []
  (tmp_path / "kept").mkdir()
  held = lock.WorkdirLock(str(tmp_path / "kept"))  # existed before: stays
  held.release()
  held = lock.WorkdirLock(str(tmp_path / "used"))
  (tmp_path / "used" / "metrics.jsonl").write_text("")
  held.release()
  assert sorted(os.listdir(tmp_path)) == ["kept", "used"] and sorted(os.listdir(tmp_path / "used")) == [
      "metrics.jsonl", lock.NAME]
