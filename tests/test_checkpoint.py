"""RL checkpoints: a damaged newest step is skipped with a warning naming it and the one before
restored; a run killed mid-save leaves a temporary directory that is ignored; arrays whose shapes
the metadata holds (per-process data) restore exactly."""

import glob
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.checkpoint import Checkpoints, stack_processes, stacked_like, unstack_processes

TREE = {"w": jnp.arange(64.0).reshape(8, 8), "opt": {"mu": jnp.ones((8,)), "count": jnp.int32(0)}}


def _three_steps(directory):
  checkpoints = Checkpoints(directory, every=1, keep=3)
  for step in (1, 2, 3):
    checkpoints.save(step, {"w": TREE["w"] * step, "opt": TREE["opt"]}, {"step": step})
  checkpoints.close()  # waits for the background writes


def _array_files(step_dir):
  return [f for f in glob.glob(os.path.join(step_dir, "arrays", "**", "d", "*"), recursive=True)]


def _truncate(step_dir):
  for f in _array_files(step_dir):
    os.truncate(f, os.path.getsize(f) // 2)


def _garble(step_dir):
  with open(os.path.join(step_dir, "arrays", "_METADATA"), "w", encoding="utf-8") as f:
    f.write('{"tree_metadata": {"w": [garbled')


def _no_metadata(step_dir):
  shutil.rmtree(os.path.join(step_dir, "meta"))


@pytest.mark.parametrize("damage", [_truncate, _garble, _no_metadata])
def test_damaged_latest_checkpoint_is_skipped(tmp_path, caplog, damage):
  _three_steps(tmp_path)
  damage(str(tmp_path / "3"))
  checkpoints = Checkpoints(str(tmp_path), every=1, keep=3)
  with caplog.at_level("WARNING"):
    step, arrays, meta = checkpoints.restore_latest(TREE)
  assert step == 2 and meta == {"step": 2}
  np.testing.assert_array_equal(arrays["w"], TREE["w"] * 2)
  assert f"checkpoint {tmp_path / '3'} does not restore" in caplog.text
  assert f"skipped damaged checkpoint {tmp_path / '3'}" in caplog.text
  # Moved aside: step 3 can be written again, and is then the latest.
  assert checkpoints.latest_step() == 2 and glob.glob(str(tmp_path / "3.corrupt-*"))
  checkpoints.save(3, TREE, {"step": 3})
  checkpoints.wait()
  assert checkpoints.restore_latest(TREE)[0] == 3
  checkpoints.close()


def test_no_restorable_checkpoint_is_an_error_naming_them(tmp_path):
  """A config that does not fit any checkpoint (here: another tree) moves nothing aside."""
  _three_steps(tmp_path)
  checkpoints = Checkpoints(str(tmp_path), every=1, keep=3)
  with pytest.raises(ValueError, match=r"no checkpoint in .* restores") as error:
    checkpoints.restore_latest({"other": jnp.zeros((3,))})
  assert all(str(tmp_path / str(s)) in str(error.value) for s in (1, 2, 3))
  assert checkpoints.manager.all_steps() == [1, 2, 3]
  checkpoints.close()


def test_interrupted_save_is_ignored(tmp_path):
  """What a kill during an async save leaves: orbax's temporary directory of the step (removed in
  the background by the next run's manager); the step before is the latest, the step is saved again."""
  _three_steps(tmp_path)
  partial = tmp_path / "4.orbax-checkpoint-tmp"
  shutil.copytree(tmp_path / "3", partial)
  _truncate(str(partial))
  checkpoints = Checkpoints(str(tmp_path), every=1, keep=3)
  assert checkpoints.restore_latest(TREE)[0] == 3
  checkpoints.save(4, TREE, {"step": 4})
  checkpoints.wait()
  assert checkpoints.restore_latest(TREE)[0] == 4
  checkpoints.close()


def test_per_process_arrays_of_any_size_restore_exactly(tmp_path):
  """`stack_processes` data (here one process's: empty, bfloat16, 3-d, a size that does not split
  over the 8 devices) saved beside other arrays; the restore reads the shapes from the metadata."""
  local = {"empty": np.zeros((0, 0), np.float32), "tokens": np.arange(13, dtype=np.int32),
           "hidden": np.random.default_rng(0).normal(size=(13, 3, 2)).astype(jnp.bfloat16)}
  checkpoints = Checkpoints(str(tmp_path), every=1, keep=2)
  for step, n in ((1, 13), (2, 5)):  # the sizes change from step to step
    stacked, spec = stack_processes({k: v[:n] for k, v in local.items()})
    assert stacked["tokens"].shape == (1, {13: 16, 5: 8}[n]) and stacked["hidden"].dtype == jnp.bfloat16
    checkpoints.save(step, {**TREE, "data": stacked}, {"step": step, "spec": spec})
  checkpoints.close()
  checkpoints = Checkpoints(str(tmp_path), every=1, keep=2)
  abstract = lambda meta: {**TREE, "data": stacked_like(meta["spec"])}
  for step, n in ((1, 13), (2, 5)):
    arrays, meta = checkpoints.restore(step, abstract)
    out = unstack_processes(arrays["data"], meta["spec"])
    for k, v in local.items():
      assert out[k].dtype == v.dtype
      np.testing.assert_array_equal(out[k], v[:n])
  assert checkpoints.restore_latest(abstract)[0] == 2
  checkpoints.close()
  # Rows written by 2 processes have no place in a 1-process run: the caller goes on without them.
  assert stacked_like({**spec, "shapes": spec["shapes"] * 2}) is None
  assert jax.process_count() == 1
