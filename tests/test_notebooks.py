"""The Colab notebooks execute in smoke mode (offline, seconds-sized shapes, one RL step).

Each notebook's "parameters" cell gets `SMOKE = True` appended. The kernels run in one shared
directory with the run's persistent XLA cache (tests/conftest.py), so a notebook reuses what others compiled.
"""

import os
import re

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import xla_flags_without_device_count

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("notebooks")


def execute(name: str, cwd, xla_cache: str) -> nbformat.NotebookNode:
  nb = nbformat.read(os.path.join(REPO, "colab", name), as_version=4)
  params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(params) == 1 and "SMOKE = False" in params[0].source, f"{name}: one parameters cell with SMOKE = False"
  params[0].source += "\nSMOKE = True"
  # The kernel imports this checkout, simulates its own CPU devices and caches what it compiles.
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
         "XLA_FLAGS": xla_flags_without_device_count(), "JAX_PLATFORMS": "cpu",
         "JAX_COMPILATION_CACHE_DIR": xla_cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "HF_HUB_OFFLINE": "1"}
  client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}})
  client.execute(env=env)
  return nb


def outputs(nb) -> str:
  return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_tiny_notebook_runs_tlt_and_baseline(run_dir, xla_cache):
  nb = execute("tlt_tiny.ipynb", run_dir, xla_cache)
  text = outputs(nb)
  assert "TLT " in text and "baseline " in text
  assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
             for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
  for arm in ("TLT", "baseline"):
    assert os.path.exists(run_dir / "runs" / "colab_tiny" / arm / "metrics.jsonl")


def test_qwen_notebook_smoke_mode_trains_and_benches(run_dir, xla_cache):
  text = outputs(execute("tlt_qwen2_5_0_5b.ipynb", run_dir, xla_cache))
  assert re.search(r"step 1: reward [\d.]+, acceptance length [\d.]+", text)
  assert re.search(r"batch   1 2_1_3   acceptance length [\d.]+  speedup [\d.]+x", text)


def test_smollm2_notebook_smoke_mode_warms_up_and_trains_both_arms(run_dir, xla_cache):
  text = outputs(execute("tlt_smollm2.ipynb", run_dir, xla_cache))
  assert re.search(r"draft head: \d+ of \d+ tokens", text)
  assert "TLT " in text and "baseline " in text
  assert os.path.exists(run_dir / "runs" / "colab_smollm2" / "drafter" / "drafter_config.json")
