"""`python -m tlt_jax.main`: bad config keys and values are rejected with their names."""

import subprocess
import sys

import pytest


def _main(*args):
  return subprocess.run([sys.executable, "-m", "tlt_jax.main", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--config.rl.bogus=1"], "unknown config key 'bogus' in --config.rl.bogus"),
    (["--config=configs/tiny.py", "--config.rollout.nope=2"], "unknown config key 'nope' in --config.rollout.nope"),
    (["--config.rl.learning_rate=fast"], "--config.rl.learning_rate=fast"),
    (["--config.rl.loss_aggregation=mean"], "config.rl.loss_aggregation='mean'"),
    (["--config.rollout.strategies=4_x_5"], "config.rollout.strategies='4_x_5'"),
])
def test_bad_config_is_rejected_by_name(args, message):
  result = _main(*args)
  assert result.returncode != 0
  assert message in result.stderr
  assert "Traceback" not in result.stderr
