"""Two processes (jax.distributed on localhost, gloo) x 4 CPU devices run `python -m tlt_jax.main`
with TLT like one process on 8 devices: 2 steps (rewards equal, the policy update equal up to
float rounding, the held-out evaluation before them equal: each process samples its share),
checkpoints written once, a run on a workdir another run holds refused by both processes, and a
fresh 2-process run restores the last checkpoint."""

import json
import os
import socket
import subprocess
import sys
import time

import ml_collections
from flax import nnx

from configs import tiny
from tests.conftest import float_order_mismatches, tiny_rl_config, xla_flags_without_device_count
from tlt_jax import lock, metrics
from tlt_jax.models import hf
from tlt_jax.rl import bootstrap
from tlt_jax.rl.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Equal in both runs: the rollout is lossless and row keys are global, so the samples are too (step
# 2's as well: it is rolled out from the initial policy, see _tlt_config).
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


def _launch(config, logdir, processes=2, timeout_s=600, refused=False):
  """`python -m tlt_jax.main` in `processes` processes of 8 / `processes` CPU devices; their logs.

  A process that fails takes the others down at once (they would wait for it until jax.distributed
  times out); `refused`: every process must exit 1 by itself (the run stopped before any work)."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = {**os.environ, "XLA_FLAGS": xla_flags_without_device_count()}  # not conftest's 8 devices per process
  env.update(JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", PYTHONPATH=ROOT)
  flags = _overrides(config, tiny.get_config()) + [
      "--config.distributed.enabled=True", f"--config.distributed.coordinator_address=localhost:{port}",
      f"--config.distributed.num_processes={processes}", f"--config.mesh.cpu_devices={8 // processes}"]
  paths = [os.path.join(logdir, f"process_{i}.log") for i in range(processes)]
  procs = []
  for i, path in enumerate(paths):
    with open(path, "w", encoding="utf-8") as log:
      command = [sys.executable, "-m", "tlt_jax.main", *flags, f"--config.distributed.process_id={i}"]
      procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
  deadline = time.monotonic() + timeout_s
  while any(p.poll() is None for p in procs):
    if (not refused and any(p.poll() not in (None, 0) for p in procs)) or time.monotonic() > deadline:
      for p in procs:
        p.kill()
    time.sleep(0.2)
  logs = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      logs.append(f.read())
  report = "".join(f"\n--- process {i} exited {p.returncode}:\n{log[-6000:]}"
                   for i, (p, log) in enumerate(zip(procs, logs)))
  assert all(p.returncode == (1 if refused else 0) for p in procs), report
  return logs


def _tlt_config(workdir, policy_dir, cache_dir, drafter_path):
  """The trainer tests' tiny run with TLT on 2 rollout groups (one per process), 2 steps."""
  c = tiny_rl_config(workdir, 2, cache_dir)
  c.rollout.speculative = True
  c.rollout.groups = 2
  c.rollout.strategies = ("2_1_3",)
  c.rollout.engine.sd_max_batch = 4
  c.drafter.path = str(drafter_path)  # absent at first: distilled on the tiny task
  c.drafter.distill.steps = 4
  c.drafter.distill.row_len = c.drafter.trainer.row_len = 64
  c.drafter.trainer.rows_per_device = 1
  c.drafter.trainer.warmup_steps = 1
  c.checkpoint.every = 1
  c.eval.every = 2  # before step 1 and after step 2: each process evaluates its share of the prompts
  c.seed = 1  # a random policy ends some responses early in both steps: rewards differ, gradients flow
  # One update a step of the 8 samples in one micro-batch, in rows barely longer than a sample
  # (prompts are 19-24 tokens, responses up to 24): 5-8 rows, so its rows on the last 4 of the 8
  # devices, process 1's, are real ones too. (The update of step 1, warm-up's first, has learning
  # rate 0: both runs roll step 2 out from the initial policy.)
  c.data.max_prompt_len = 24
  c.rl.row_len = 48
  c.rl.mini_batches = 1
  c.rl.actor.micro_batch_rows = 8
  # The drafter warm-up needs the tiny world's tokenizer: the policy goes where the trainer looks
  # for the tiny one (policy.path stays empty).
  os.makedirs(workdir, exist_ok=True)
  os.symlink(policy_dir, os.path.join(workdir, "policy"))
  return c


def test_two_processes_match_one(tmp_path, tiny_policy_dir, xla_cache, monkeypatch):
  """The rollouts are equal (rewards, lengths, sample counts). The policy updates are equal up to
  float rounding (two processes all-reduce 8 devices' gradient shards where one process sums them
  on one device): tests/conftest.py `float_order_mismatches` bounds the L2 gap between the final
  policies, not each element (Adam's steps magnify rounding where a gradient is near 0), and the
  losses and gradient norms. Measured gap: rounding 1.3e-6 of the update (bound 1e-2); with
  process 0's gradient doubled 0.45, with one of process 1's 4 shards dropped 0.34."""
  drafter, two, one = tmp_path / "drafter", tmp_path / "two", tmp_path / "one"
  c = _tlt_config(two, tiny_policy_dir, xla_cache, drafter)
  _launch(c, tmp_path)  # process 0 warms the drafter up while process 1 waits, then both run 2 steps
  records = metrics.read(str(two / "metrics.jsonl"))  # process 0's alone
  assert [r["step"] for r in records] == [0, 1, 2] and all(r["spot/groups"] == 2 for r in records[1:])
  assert records[-1]["drafter/version"] >= 1 and sorted(os.listdir(two / "checkpoints")) == ["1", "2"]
  os.rename(two / "export", tmp_path / "export")
  # While another run holds the workdir, both processes of a new run refuse it, naming that run.
  held = lock.WorkdirLock(str(two))
  try:
    refusals = _launch(c, tmp_path, refused=True)
  finally:
    held.release()
  assert all(f"is in use by another run (pid {os.getpid()} on " in log for log in refusals), refusals
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
  config = _tlt_config(one, tiny_policy_dir, xla_cache, drafter)
  trainer = Trainer(config, *bootstrap.load(config))
  rows = []  # of each update's micro-batch: the same in both runs
  update = trainer.actor.update
  monkeypatch.setattr(trainer.actor, "update", lambda batch: rows.append(len(batch["tokens"])) or update(batch))
  try:
    reference = trainer.run()
    params = trainer.actor.params
  finally:
    trainer.close()
  assert len(rows) == 2 and min(rows) > 4, rows  # process 1's devices hold rows of every update
  exact = lambda record: {k: v for k, v in record.items() if k.startswith(EXACT)}
  assert [exact(r) for r in records[1:]] == [exact(r) for r in reference]
  # The evaluation of the initial policy: the held-out prompts (2: one of the 3 is too long) split 1 + 1.
  at_start = lambda record: {k: v for k, v in record.items() if k.startswith("eval/")}
  first = metrics.read(str(one / "metrics.jsonl"))[0]
  assert first["step"] == 0 and at_start(records[0]) == at_start(first) and len(first["eval/prompt_rewards"]) == 2
  stats = lambda records: [{k: r[f"train/{k}"] for k in ("loss", "grad_norm")} for r in records]
  assert all(r["train/grad_norm"] > 0 for r in reference)
  initial = nnx.state(hf.from_pretrained(tiny_policy_dir))
  exported = nnx.state(hf.from_pretrained(str(two / "export" / "policy")))
  assert not float_order_mismatches(initial, (params, stats(reference)), (exported, stats(records[1:])))
