"""Metrics: JSONL records, what a resume keeps, TensorBoard's scalars and the optional Weights & Biases run
(offline)."""

import os
import subprocess
import sys

import pytest

from tlt_jax import metrics


def test_a_resume_keeps_the_records_up_to_its_step(tmp_path):
  writer = metrics.Writer(str(tmp_path))
  for step in (1, 2, 3):
    writer.write(step, {"reward/mean": step / 10, "eval/prompt_rewards": [0.5, 1.0]})
  writer.close()
  resumed = metrics.Writer(str(tmp_path), resume_step=2)  # step 3 was never checkpointed
  resumed.write(3, {"reward/mean": 0.7})
  resumed.close()
  assert [(r["step"], r["reward/mean"]) for r in metrics.read(str(tmp_path / "metrics.jsonl"))] == [
      (1, 0.1), (2, 0.2), (3, 0.7)]


def _completions(n):
  return [{"prompt": i // 2, "sample": i % 2, "prompt_text": "2 + 2?", "completion": f"It is | {i}\nAnswer: 4",
           "reward": 1.0, "advantage": 0.5 - i, "length": 9, "finish_reason": "stop", "trained": True}
          for i in range(n)]


def test_completions_go_to_jsonl_and_a_tensorboard_table_and_a_resume_keeps_them_to_its_step(tmp_path, monkeypatch):
  writer = metrics.Writer(str(tmp_path))
  texts = []
  monkeypatch.setattr(writer.tensorboard, "add_text", lambda tag, text, step: texts.append((tag, text, step)))
  for step in (1, 2):
    writer.write_completions(step, _completions(2))
  writer.close()
  [(tag, text, step)] = texts[1:]
  lines = text.splitlines()
  assert tag == "completions" and step == 2 and lines[0] == "| " + " | ".join(metrics.COMPLETION_KEYS) + " |"
  assert lines[3] == "| 0 | 1 | 2 + 2? | It is \\| 1<br>Answer: 4 | 1.000 | -0.500 | 9 | stop | True |"
  metrics.Writer(str(tmp_path), resume_step=1).close()
  rows = metrics.read(str(tmp_path / "completions.jsonl"))
  assert rows == [{"step": 1, **r} for r in _completions(2)]


def test_tensorboard_gets_every_finite_scalar_under_a_name_it_takes(tmp_path, monkeypatch):
  tags = []
  writer = metrics.Writer(str(tmp_path))
  monkeypatch.setattr(writer.tensorboard, "add_scalar", lambda tag, value, step: tags.append((tag, value, step)))
  writer.write(1, {"eval/pass@4": 0.5, "reward/mean": 0.25, "eval/prompt_rewards": [0.5], "bad": float("nan")})
  writer.close()
  assert tags == [("eval/pass_4", 0.5, 1), ("reward/mean", 0.25, 1)]


def test_the_package_starts_without_torch_and_leaves_it_importable(tmp_path):
  """tensorboardX would import torch (installed here, as on the GPU image): seconds of every CLI's start-up.
  `tlt_jax.main` imports without it, TensorBoard's event file is still written, and torch imports after."""
  code = ("import sys; from tlt_jax import main, metrics; loaded = 'torch' in sys.modules; "
          f"w = metrics.Writer({str(tmp_path)!r}); w.write(1, {{'reward/mean': 0.5}}); w.close(); "
          "import torch; print(loaded, torch.ones(2).sum().item())")
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert run.returncode == 0 and run.stdout.split() == ["False", "2.0"], run.stderr[-3000:]
  assert os.listdir(tmp_path / "tensorboard")


def test_a_wandb_run_gets_every_scalar_and_a_resume_continues_it(tmp_path, monkeypatch):
  wandb = pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  run = metrics.wandb_run(str(tmp_path), "tlt_jax_test", config={"steps": 2})
  writer = metrics.Writer(str(tmp_path), wandb=run)
  writer.write(1, {"reward/mean": 0.25, "eval/prompt_rewards": [0.5], "bad": float("nan")})
  writer.write_completions(2, _completions(3))
  writer.write(2, {"reward/mean": 0.5})
  logged = set(run.summary.keys())
  assert "completions" in logged  # the table
  assert run.summary["reward/mean"] == 0.5 and "eval/prompt_rewards" not in logged and "bad" not in logged
  assert run.name == tmp_path.name and run.config["steps"] == 2
  writer.close()
  run_id = (tmp_path / "wandb_run_id").read_text()
  assert any(name.endswith(run_id) for name in os.listdir(tmp_path / "wandb"))  # offline-run-<time>-<id>
  resumed = metrics.wandb_run(str(tmp_path), "tlt_jax_test")
  assert resumed.id == run_id
  resumed.finish()
  assert wandb.run is None
