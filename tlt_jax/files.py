"""Atomic outputs: written under a temporary name beside the final one, then renamed.

Nothing half-written is ever left under the final name, outputs get the permissions the umask
gives (not a temporary file's 0600 / 0700), and an output replaces only what its writer could
have made: an empty directory or an earlier output of the same kind (`is_own`), never a model, a
data set or anything else that happens to be at the path.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from typing import Callable, Iterator


class OutputError(ValueError):
  """An output path we refuse to write; the message names it and why."""


def contains(outer: str, inner: str) -> bool:
  """Whether the path `inner` is `outer` or lies inside it (symbolic links resolved)."""
  outer, inner = os.path.realpath(outer), os.path.realpath(inner)
  return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def check_replaceable(path: str, kind: str, is_own: Callable[[str], bool]) -> None:
  """Raises OutputError unless writing the directory `path` would replace nothing, an empty
  directory, or what `is_own(path)` recognises as an earlier output of `kind` ("a drafter
  checkpoint"). Messages say why; the caller names the path."""
  if not os.path.lexists(path):
    return
  if not os.path.isdir(path) or os.path.islink(path):
    raise OutputError("it exists and is not a directory")
  if os.listdir(path) and not is_own(path):
    raise OutputError(f"it exists and is not {kind}: refusing to replace it")


def check_writable(path: str) -> None:
  """Raises OutputError unless `path` can be created: its nearest existing ancestor is a directory
  we can create entries in (tried with a temporary directory, which is removed). The caller names
  the path."""
  parent = os.path.dirname(os.path.abspath(path))
  while not os.path.lexists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise OutputError(f"{parent} is not a directory")
  try:
    os.rmdir(_fresh(parent, os.path.basename(path), os.mkdir))
  except OSError as e:
    raise OutputError(f"cannot write in {parent} ({e.strerror})") from None


@contextlib.contextmanager
def atomic_directory(path: str, kind: str, is_own: Callable[[str], bool]) -> Iterator[str]:
  """Yields a fresh temporary directory beside `path`; when the block succeeds it replaces `path`,
  when it raises it is removed and `path` is untouched. An existing `path` must pass
  `check_replaceable(path, kind, is_own)`, checked before the block runs and again before the swap."""
  path = os.path.abspath(path)
  def check():
    try:
      check_replaceable(path, kind, is_own)
    except OutputError as e:
      raise OutputError(f"{path}: {e}") from None
  check()
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = _fresh(parent, os.path.basename(path), os.mkdir)
  try:
    yield tmp
    _umask_modes(tmp)
    check()
    if os.path.exists(path):
      shutil.rmtree(path)
    os.replace(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[str]:
  """Yields a fresh temporary file path beside `path` (the file exists, empty) to write; when the
  block succeeds it replaces `path`, when it raises it is removed and `path` is untouched."""
  path = os.path.abspath(path)
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = _fresh(parent, os.path.basename(path), lambda p: os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                                                                          0o666)))
  try:
    yield tmp
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)
    raise


def _fresh(parent: str, name: str, create: Callable[[str], None]) -> str:
  """Creates a new entry `parent/.tmp-<name>-<random>` with `create` (which honours the umask, unlike
  `tempfile`'s private 0600 / 0700 modes) and returns its path."""
  while True:
    tmp = os.path.join(parent, f".tmp-{name}-{secrets.token_hex(4)}")
    try:
      create(tmp)
      return tmp
    except FileExistsError:
      continue


def _umask_modes(root: str) -> None:
  """Gives everything under `root` the modes the umask gives new entries (libraries write some files
  0600): `root` was made by os.mkdir(0o777), so its mode is the umask's directory mode."""
  dir_mode = os.stat(root).st_mode & 0o777
  for top, dirs, names in os.walk(root):
    for d in dirs:
      os.chmod(os.path.join(top, d), dir_mode)
    for n in names:
      if not os.path.islink(os.path.join(top, n)):
        os.chmod(os.path.join(top, n), dir_mode & 0o666)
