"""Atomic directory writes: nothing half-written is ever left under the final name."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator


@contextlib.contextmanager
def atomic_directory(path: str) -> Iterator[str]:
  """Yields a fresh temporary directory beside `path`; when the block succeeds it replaces `path`
  (whatever was there), when it raises it is removed and `path` is untouched."""
  path = os.path.abspath(path)
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(path), dir=parent)
  try:
    yield tmp
    if os.path.exists(path):
      shutil.rmtree(path)
    os.replace(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
