"""The experiment scripts start: each one's imports and absl flags load (a flag defined twice, in the
script and in a module it imports, fails at import), and its --helpshort lists its own flags. Running
them takes minutes each; docs/BENCHMARKS.md records what they measured."""

import os
import subprocess
import sys

import pytest

EXPERIMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments")
SCRIPTS = sorted(f[:-3] for f in os.listdir(EXPERIMENTS) if f.endswith(".py") and f != "starting_point.py")


@pytest.fixture(scope="module")
def help_runs():
  """(exit code, stdout, stderr) of `python experiments/SCRIPT.py --helpshort` per script, all started
  at once: each in its own process, as a user runs it."""
  procs = {s: subprocess.Popen([sys.executable, f"{s}.py", "--helpshort"], cwd=EXPERIMENTS, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE) for s in SCRIPTS}
  outputs = {s: p.communicate(timeout=600) for s, p in procs.items()}
  return {s: (procs[s].returncode, *outputs[s]) for s in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS)
def test_experiment_flags_load(script, help_runs):
  code, stdout, stderr = help_runs[script]
  assert "Traceback" not in stderr, stderr[-3000:]
  assert code == 1 and f"{script}.py" in stdout, stdout[-2000:]  # absl's help: its flags, exit status 1
