"""Atomic outputs: replace on success, untouched on failure, no temporary left, only their own kind
replaced, modes from the umask."""

import os
import stat

import pytest

from tlt_jax import files

is_own = lambda path: os.path.exists(os.path.join(path, "mine"))


def _write(directory, name, text="1"):
  with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
    f.write(text)


def test_atomic_directory_replaces_or_leaves_untouched(tmp_path):
  target = tmp_path / "out"
  with files.atomic_directory(str(target), "a test output", is_own) as tmp:
    _write(tmp, "mine")
  assert sorted(os.listdir(target)) == ["mine"]
  with pytest.raises(RuntimeError):
    with files.atomic_directory(str(target), "a test output", is_own) as tmp:
      _write(tmp, "b")
      raise RuntimeError("crash mid-write")
  assert sorted(os.listdir(target)) == ["mine"]
  assert sorted(os.listdir(tmp_path)) == ["out"]
  with files.atomic_directory(str(target), "a test output", is_own) as tmp:
    _write(tmp, "mine", "2")
  assert (target / "mine").read_text() == "2"


def test_atomic_directory_replaces_only_its_own_kind(tmp_path):
  """A directory of another kind (a model, a data set) is never deleted, checked before the block runs;
  an empty directory is fine."""
  other = tmp_path / "model"
  other.mkdir()
  _write(other, "config.json")
  ran = []
  with pytest.raises(files.OutputError, match=r"model: it exists and is not a test output: refusing to replace it"):
    with files.atomic_directory(str(other), "a test output", is_own):
      ran.append(True)
  assert not ran and os.listdir(other) == ["config.json"] and sorted(os.listdir(tmp_path)) == ["model"]
  (tmp_path / "file").write_text("x")
  with pytest.raises(files.OutputError, match="file: it exists and is not a directory"):
    with files.atomic_directory(str(tmp_path / "file"), "a test output", is_own):
      pass
  (tmp_path / "empty").mkdir()
  with files.atomic_directory(str(tmp_path / "empty"), "a test output", is_own) as tmp:
    _write(tmp, "mine")
  assert os.listdir(tmp_path / "empty") == ["mine"]


def test_outputs_honour_the_umask(tmp_path):
  old = os.umask(0o027)
  try:
    with files.atomic_directory(str(tmp_path / "d"), "a test output", is_own) as tmp:
      os.mkdir(os.path.join(tmp, "sub"), 0o700)  # as libraries do
      _write(os.path.join(tmp, "sub"), "mine")
      os.chmod(os.path.join(tmp, "sub", "mine"), 0o600)
    with files.atomic_file(str(tmp_path / "f.jsonl")) as tmp:
      _write(os.path.dirname(tmp), os.path.basename(tmp))
  finally:
    os.umask(old)
  mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)
  assert (mode(tmp_path / "d"), mode(tmp_path / "d" / "sub"), mode(tmp_path / "d" / "sub" / "mine")) == (
      0o750, 0o750, 0o640)
  assert mode(tmp_path / "f.jsonl") == 0o640


def test_atomic_file_replaces_or_leaves_untouched(tmp_path):
  target = tmp_path / "out.json"
  target.write_text("old")
  with pytest.raises(RuntimeError):
    with files.atomic_file(str(target)) as tmp:
      _write(os.path.dirname(tmp), os.path.basename(tmp), "half")
      raise RuntimeError("crash mid-write")
  assert target.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]
  with files.atomic_file(str(target)) as tmp:
    _write(os.path.dirname(tmp), os.path.basename(tmp), "new")
  assert target.read_text() == "new" and os.listdir(tmp_path) == ["out.json"]


def test_check_writable(tmp_path):
  files.check_writable(str(tmp_path / "a" / "b"))  # a missing parent is created later
  (tmp_path / "file").write_text("x")
  with pytest.raises(files.OutputError, match="file is not a directory"):
    files.check_writable(str(tmp_path / "file" / "b"))
  assert sorted(os.listdir(tmp_path)) == ["file"]


def test_contains(tmp_path):
  a = str(tmp_path / "a")
  assert files.contains(a, a) and files.contains(a, a + "/b/c") and files.contains(a, a + "/b/..")
  assert not files.contains(a, a + "b") and not files.contains(a + "/b", a)
