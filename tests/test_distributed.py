"""Two processes (jax.distributed on localhost, gloo) x 4 CPU devices run `python -m tlt_jax.main`
with TLT like one process on 8 devices: 2 steps (rewards equal, policy within float tolerance),
checkpoints written once, and a fresh 2-process run restores the last one."""

import json
import os
import socket
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
from flax import nnx

from configs import tiny
from tests.conftest import tiny_rl_config
from tlt_jax import metrics
from tlt_jax.models import hf
from tlt_jax.rl.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Equal in both runs: the rollout is lossless and row keys are global, so the samples are too.
EXACT = ("reward/", "response_length/", "groups_kept", "samples_trained", "train/updates")


def _overrides(config, base, prefix="--config."):
  """`--config.key=value` for every value of `config` that differs from `base`."""
  out = []
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      out += _overrides(value, base[key], f"{prefix}{key}.")
    elif value != base[key]:
      out.append(f"{prefix}{key}={value}")
  return out


def _launch(config, logdir, processes=2, timeout_s=600):
  """`python -m tlt_jax.main` in `processes` processes of 8 / `processes` CPU devices; their logs.

  A process that fails takes the others down at once (they would wait for it until jax.distributed
  times out)."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # not conftest's 8 devices per process
  env.update(JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", PYTHONPATH=ROOT)
  flags = _overrides(config, tiny.get_config()) + [
      "--config.distributed.enabled=True", f"--config.distributed.coordinator_address=localhost:{port}",
      f"--config.distributed.num_processes={processes}", f"--config.mesh.cpu_devices={8 // processes}"]
  paths = [os.path.join(logdir, f"process_{i}.log") for i in range(processes)]
  procs = []
  for i, path in enumerate(paths):
    with open(path, "w", encoding="utf-8") as log:
      procs.append(subprocess.Popen([sys.executable, "-m", "tlt_jax.main", *flags, f"--config.distributed.process_id={i}"],
                                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
  deadline = time.monotonic() + timeout_s
  while any(p.poll() is None for p in procs):
    if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
      for p in procs:
        p.kill()
    time.sleep(0.2)
  logs = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      logs.append(f.read())
  report = "".join(f"\n--- process {i} exited {p.returncode}:\n{log[-6000:]}" for i, (p, log) in enumerate(zip(procs, logs)))
  assert all(p.returncode == 0 for p in procs), report
  return logs


def _tlt_config(workdir, policy_dir, cache_dir, drafter_path):
  """The trainer tests' tiny run with TLT on 2 rollout groups (one per process), 2 steps."""
  c = tiny_rl_config(workdir, 2, cache_dir)
  c.rollout.speculative = True
  c.rollout.groups = 2
  c.rollout.strategies = "2_1_3"
  c.rollout.sd_max_batch = 4
  c.drafter.path = str(drafter_path)  # absent at first: warmed up on the tiny task
  c.drafter.warmup_steps = 4
  c.drafter.row_len = 64
  c.drafter.online_rows_per_device = 1
  c.drafter.online_warmup_steps = 1
  c.checkpoint.every = 1
  c.eval.every = 0  # held-out evaluation is single-process only
  c.seed = 1  # a random policy ends some responses early in both steps: rewards differ, gradients flow
  c.rl.micro_batch_rows = 8  # the 2-process update splits each micro-batch over the 8 devices
  # The drafter warm-up needs the tiny world's tokenizer: the policy goes where the trainer looks
  # for the tiny one (policy.path stays empty).
  os.makedirs(workdir, exist_ok=True)
  os.symlink(policy_dir, os.path.join(workdir, "policy"))
  return c


def test_two_processes_match_one(tmp_path, tiny_policy_dir, xla_cache):
  drafter, two, one = tmp_path / "drafter", tmp_path / "two", tmp_path / "one"
  c = _tlt_config(two, tiny_policy_dir, xla_cache, drafter)
  _launch(c, tmp_path)  # process 0 warms the drafter up while process 1 waits, then both run 2 steps
  records = metrics.read(str(two / "metrics.jsonl"))  # process 0's alone
  assert [r["step"] for r in records] == [1, 2] and all(r["spot/groups"] == 2 for r in records)
  assert records[-1]["drafter/version"] >= 1 and sorted(os.listdir(two / "checkpoints")) == ["1", "2"]
  os.rename(two / "export", tmp_path / "export")
  # A fresh 2-process run restores step 2 (drafter, each process's drafter data buffer, bandits) and exports it again.
  logs = _launch(c, tmp_path)
  assert all("resumed from" in log and "at step 2" in log for log in logs)
  with open(two / "checkpoints" / "2" / "meta" / "metadata", encoding="utf-8") as f:  # each process's buffer
    shapes = json.load(f)["drafter"]["buffer_state"]["arrays"]["shapes"]
  for log, shape in zip(logs, shapes, strict=True):
    assert f"data buffer of {shape['entries'][0]} samples ({shape['tokens'][0] - shape['entries'][0]} pairs)" in log
  for part in ("policy/model.safetensors", "drafter/model.safetensors"):
    with open(two / "export" / part, "rb") as f, open(tmp_path / "export" / part, "rb") as g:
      assert f.read() == g.read(), part

  # 1 process, all 8 devices, the same rollout groups.
  trainer = Trainer(_tlt_config(one, tiny_policy_dir, xla_cache, drafter))
  try:
    reference = trainer.run()
    params = trainer.actor.params
  finally:
    trainer.close()
  for mine, ref in zip(records, reference, strict=True):
    assert {k: v for k, v in mine.items() if k.startswith(EXACT)} == {k: v for k, v in ref.items() if k.startswith(EXACT)}
    # One process sums a micro-batch's gradient on one device; two sum 8 devices' shards (all-reduce):
    # another order of float additions.
    np.testing.assert_allclose(mine["train/loss"], ref["train/loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(mine["train/grad_norm"], ref["train/grad_norm"], rtol=1e-5)
  assert all(r["train/grad_norm"] > 0 for r in reference)
  exported = nnx.state(hf.from_pretrained(str(two / "export" / "policy")))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
               exported, params)
