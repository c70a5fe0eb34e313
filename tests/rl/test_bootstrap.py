"""The run's inputs: the tiny world's policy found in a workdir is the config's, or the run stops naming why."""

import shutil

import pytest

from tlt_jax import config as config_lib
from tlt_jax.rl import bootstrap


def test_a_smoke_variant_keeps_its_own_workdir():
  assert config_lib.get_config("smoke").workdir == "runs/tiny_smoke" != config_lib.get_config().workdir


def test_a_policy_another_config_trained_in_the_workdir_is_refused_by_name(tmp_path, tiny_policy_dir):
  """The smoke's 2-layer policy left in the workdir the full config then uses: one error naming the shape keys
  that differ, before anything trains on it."""
  shutil.copytree(tiny_policy_dir, tmp_path / "policy")
  c = config_lib.get_config()
  c.workdir = str(tmp_path)
  with pytest.raises(ValueError) as e:
    bootstrap.load_policy(c)
  assert str(e.value) == (
      f"config.workdir={str(tmp_path)!r}: its policy ({tmp_path / 'policy'}) has hidden_size=32, "
      "intermediate_size=64, num_layers=2; config.model asks for hidden_size=96, intermediate_size=384, "
      "num_layers=6 (another config trained it): set config.workdir to another directory or remove this one")
  c.model.hidden_size, c.model.num_layers, c.model.intermediate_size = 32, 2, 64  # its own shape: loads
  assert bootstrap.load_policy(c)[0].config.num_layers == 2
