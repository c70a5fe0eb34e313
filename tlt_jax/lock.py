"""One run per workdir: an advisory lock on <workdir>/run.lock, held while the run lives.

`fcntl.flock` takes it atomically, and the kernel releases it when the process ends, however it
ends (SIGKILL included): a lock file left by a dead run holds no lock, and the next run takes it
over. The file records its holder (pid, host, start time, command), which a refused run names.
A run that wrote nothing else (bad input, found after the lock was taken) leaves nothing: `release`
removes the file and the directories the lock made. A filesystem without locks (some network mounts)
gets a warning and no lock.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import shlex
import socket
import sys

from absl import logging

NAME = "run.lock"


class InUse(RuntimeError):
  """Another live process holds the workdir's lock; the message names it."""


class WorkdirLock:
  """Holds <workdir>/run.lock from construction to `release` (or the process's end)."""

  def __init__(self, workdir: str):
    workdir = os.path.abspath(workdir)
    self._workdir, self._made, at = workdir, None, workdir  # _made: the outermost directory the lock creates
    while not os.path.exists(at):
      self._made, at = at, os.path.dirname(at)
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, NAME)
    self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = self._holder()
      self.release()
      raise InUse(f"{os.path.dirname(self.path)} is in use by another run ({holder}); wait for it to end, or "
                  "give this run another workdir") from None
    except OSError as e:  # no locks on this filesystem
      logging.warning("cannot lock %s (%s): nothing stops a second run on this workdir", self.path, e.strerror)
      self.release()
      return
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
              "command": shlex.join([os.path.basename(sys.executable), *sys.argv])}
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, (json.dumps(record) + "\n").encode(), 0)

  def _holder(self) -> str:
    try:
      with open(self.path, encoding="utf-8") as f:
        r = json.load(f)
      return f"pid {r['pid']} on {r['host']}, started {r['started']}: {r['command']}"
    except (OSError, ValueError, KeyError, TypeError):  # caught between its creation and its record
      return "its record is not written yet"

  def release(self) -> None:
    """Releases the lock. The file stays for a later run to take over, unless the workdir holds nothing else
    and the lock made it: then the file and the directories it made go (removed while locked, so that no
    other run takes a lock on a removed file)."""
    if self._fd is None:
      return
    if self._made is not None and os.listdir(self._workdir) == [NAME]:
      os.remove(self.path)
      at = self._workdir
      while True:
        os.rmdir(at)
        if at == self._made:
          break
        at = os.path.dirname(at)
    os.close(self._fd)  # closing the only descriptor of the open file releases its flock
    self._fd = None
