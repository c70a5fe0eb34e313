"""Atomic directory writes: replace on success, untouched on failure, no temporary left."""

import os

import pytest

from tlt_jax import files


def test_atomic_directory_replaces_or_leaves_untouched(tmp_path):
  target = tmp_path / "out"
  with files.atomic_directory(str(target)) as tmp:
    (open(os.path.join(tmp, "a"), "w")).write("1")
  assert (target / "a").read_text() == "1"
  with pytest.raises(RuntimeError):
    with files.atomic_directory(str(target)) as tmp:
      (open(os.path.join(tmp, "b"), "w")).write("2")
      raise RuntimeError("crash mid-write")
  assert sorted(os.listdir(target)) == ["a"]
  assert sorted(os.listdir(tmp_path)) == ["out"]
  with files.atomic_directory(str(target)) as tmp:
    (open(os.path.join(tmp, "c"), "w")).write("3")
  assert sorted(os.listdir(target)) == ["c"]
