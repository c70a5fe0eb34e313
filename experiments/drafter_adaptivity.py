"""Adaptive vs frozen drafter while the target drifts (TLT's 6.53 vs 4.59 acceptance experiment).

  python experiments/drafter_adaptivity.py [--policy=runs/tiny/policy --drafter=runs/tiny/drafter \\
      --out=runs/drafter_adaptivity --steps=12 --drift_steps=10 --groups=2]

Start: the tiny policy and its distilled drafter. Every step k: (1) the same prompts are rolled
out twice: through the TLT rollout's data-parallel engines (--groups device groups) with the
adaptive drafter, which trains on the groups that finished first from the rollout's captured
features, and through one plain engine with a frozen copy of the starting drafter; (2) the
target drifts: --drift_steps SFT steps on a different task mix (--drift_family, 2-digit
operands). Both rollouts must give identical samples (lossless speculation, whatever the drafter
and the sharding); their acceptance lengths are compared. Writes CSV + PNG to --out and prints
a JSON summary.

Time the drafter training adds to a step: `overrun_s`, from the last group's finish to the end of
the drafter step running then (the preemption granularity), plus the push of the new drafter.
On simulated CPU devices the groups also share the machine's cores, so training on a finished
group slows the groups still decoding; on separate accelerators that contention does not exist.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()

import csv  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from tlt_jax import packing  # noqa: E402
from tlt_jax.drafter import checkpoint  # noqa: E402
from tlt_jax.drafter.buffer import BufferConfig, DataBuffer  # noqa: E402
from tlt_jax.drafter.trainer import DrafterTrainerConfig  # noqa: E402
from tlt_jax.models import hf  # noqa: E402
from tlt_jax.rl import datasets, sft, tasks  # noqa: E402
from tlt_jax.rollout.engine import Engine  # noqa: E402
from tlt_jax.rollout.state import EngineConfig  # noqa: E402
from tlt_jax.rollout.sampling import SamplingParams  # noqa: E402
from tlt_jax.rollout.speculative import Strategy  # noqa: E402
from tlt_jax.rollout.tlt import TLTRollout  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(os.path.dirname(__file__), "..", "configs",
                                                                 "tiny.py"), "Config of the SFT data and task.")
_POLICY = flags.DEFINE_string("policy", "runs/tiny/policy", "Starting policy (HF directory).")
_DRAFTER = flags.DEFINE_string("drafter", "runs/tiny/drafter", "Starting drafter (tlt_jax drafter checkpoint).")
_OUT = flags.DEFINE_string("out", "runs/drafter_adaptivity", "Output directory for CSV, PNG and JSON.")
_STEPS = flags.DEFINE_integer("steps", 12, "RL steps (rollout + drift).")
_DRIFT_STEPS = flags.DEFINE_integer("drift_steps", 10, "SFT steps of target drift after each rollout.")
_DRIFT_LR = flags.DEFINE_float("drift_lr", 2e-3, "Learning rate of the drift.")
_DRIFT_FAMILY = flags.DEFINE_string("drift_family", "chain_sum", "Task family the target drifts towards.")
_PROMPTS = flags.DEFINE_integer("prompts", 16, "Prompts per rollout.")
_SAMPLES = flags.DEFINE_integer("num_samples", 4, "Samples per prompt.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Response budget.")
_MAX_TERMS = flags.DEFINE_integer("max_terms", 24, "Most terms of the drift task's problems (the long tail).")
_GROUPS = flags.DEFINE_integer("groups", 2, "Device groups (one simulated CPU device each by default).")
_STRATEGY = flags.DEFINE_string("strategy", "4_1_5", "Draft strategy depth_topk_verify.")
_LR = flags.DEFINE_float("learning_rate", 3e-3, "Online drafter learning rate (after a 20-step warmup).")
_ROWS = flags.DEFINE_integer("rows_per_device", 4, "Packed rows per device per drafter step.")


def make_drift(policy, tok, difficulty, cfg):
  """`drift(k)`: SFT steps of the policy on the drift task (one compiled step for the whole run)."""
  examples = datasets.from_tasks(_DRIFT_FAMILY.value, tok, size=2000, seed=100, difficulty=difficulty)
  rows = packing.pack(sft.sequences(examples, tok), cfg.sft.row_len, truncate=False)
  optimizer = optax.adamw(_DRIFT_LR.value, b1=0.9, b2=0.98, weight_decay=cfg.sft.weight_decay)
  graphdef, params = nnx.split(policy)
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: sft.lm_loss(nnx.merge(graphdef, p), *batch))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(0)

  def drift():
    nonlocal params, opt_state
    loss = None
    for _ in range(_DRIFT_STEPS.value):
      take = rng.choice(rows.shape[1], cfg.sft.batch_rows, replace=False)
      params, opt_state, loss = step(params, opt_state, tuple(rows[:, take]))
    nnx.update(policy, params)
    return float(loss)

  return drift


def main(argv):
  del argv
  os.makedirs(_OUT.value, exist_ok=True)
  policy = hf.from_pretrained(_POLICY.value)
  tok = hf.load_tokenizer(_POLICY.value)
  cfg = _CONFIG.value
  base = sft.difficulty(cfg)
  difficulty = tasks.Difficulty(base.min_terms, _MAX_TERMS.value, base.tail_alpha, min_digits=2, max_digits=2)
  drift = make_drift(policy, tok, difficulty, cfg)

  pow2 = lambda n: tuple(2**i for i in range(int(np.ceil(np.log2(n))) + 1))  # buckets 1, 2, 4, ... >= n
  buckets = pow2(-(-_PROMPTS.value // _GROUPS.value) * _SAMPLES.value)
  # No compaction: fewer executables to compile (the tail runs at the full bucket).
  engine_config = EngineConfig(batch_buckets=buckets, max_prompt_len=192, max_new_tokens=_MAX_NEW.value,
                               capture_hidden=True, strategies=(Strategy.parse(_STRATEGY.value),),
                               sd_max_batch=buckets[-1], compact=False)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=_MAX_NEW.value, stop_token_ids=(tok.eos_token_id,),
                            seed=0)
  devices = jax.devices()
  training = DrafterTrainerConfig(learning_rate=_LR.value, rows_per_device=_ROWS.value, row_len=128, eval_rows=8,
                                  checkpoint_dir=os.path.abspath(os.path.join(_OUT.value, "drafter_ckpt")))
  adaptive = TLTRollout(policy, checkpoint.load_drafter(_DRAFTER.value, policy.config), engine_config, sampling,
                        devices, _GROUPS.value, DataBuffer(BufferConfig(eval_every=8)), drafter_config=training)
  everything = pow2(_PROMPTS.value * _SAMPLES.value)
  frozen = Engine(policy, EngineConfig(**{**engine_config.__dict__, "capture_hidden": False,
                                          "sd_max_batch": everything[-1], "batch_buckets": everything}),
                  sampling, drafter=checkpoint.load_drafter(_DRAFTER.value, policy.config))
  records = []
  start = time.perf_counter()
  for k in range(_STEPS.value):
    prompts = [ex.prompt_ids for ex in datasets.from_tasks(_DRIFT_FAMILY.value, tok, size=_PROMPTS.value,
                                                           seed=1000 + k, difficulty=difficulty)]
    samples_a, m_a = adaptive.generate(prompts, _SAMPLES.value)
    rollout_f = frozen.generate(prompts, _SAMPLES.value)
    samples_f = rollout_f.samples
    same = all(np.array_equal(a.tokens, b.tokens) for a, b in zip(samples_a, samples_f))
    t0 = time.perf_counter()
    drift_loss = drift()
    state = nnx.state(policy)
    adaptive.set_policy_params(state)
    frozen.set_params(state)
    record = {"step": k, "accept_adaptive": m_a["rollout/accept_len"], "accept_frozen": rollout_f.metrics.accept_len,
              "drafter_steps": m_a["drafter/steps"], "drafter_loss": m_a.get("drafter/loss", float("nan")),
              "drafter_top1": m_a.get("drafter/top1", float("nan")), "version_used": m_a["drafter/version_used"],
              "wall_adaptive_s": m_a["spot/wall_s"],
              "idle_device_s": m_a["spot/idle_device_s"], "harvested_device_s": m_a["spot/harvested_device_s"],
              "overrun_s": m_a["spot/overrun_s"], "checkpoint_s": m_a["spot/checkpoint_s"],
              "tokens": m_a["rollout/tokens"], "identical_samples": same,
              "drift_loss": drift_loss, "drift_s": time.perf_counter() - t0}
    records.append(record)
    print(json.dumps(record), flush=True)

  with open(os.path.join(_OUT.value, "drafter_adaptivity.csv"), "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=list(records[0]))
    writer.writeheader()
    writer.writerows(records)
  plot(records, os.path.join(_OUT.value, "drafter_adaptivity.png"))
  last = records[-1]
  summary = {"steps": _STEPS.value, "drift_steps": _DRIFT_STEPS.value, "strategy": _STRATEGY.value,
             "accept_adaptive_last": last["accept_adaptive"], "accept_frozen_last": last["accept_frozen"],
             "ratio_last": last["accept_adaptive"] / max(last["accept_frozen"], 1e-9),
             "all_identical": all(r["identical_samples"] for r in records),
             # Steps 1.. (step 0 compiles the engines of both trainers).
             "wall_adaptive_s": sum(r["wall_adaptive_s"] for r in records[1:]),
             "overrun_s_mean": float(np.mean([r["overrun_s"] for r in records[1:]] or [0.0])),
             "harvested_fraction": sum(r["harvested_device_s"] for r in records) /
                                   max(sum(r["idle_device_s"] for r in records), 1e-9),
             "seconds": round(time.perf_counter() - start, 1)}
  with open(os.path.join(_OUT.value, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  print(json.dumps(summary))


def plot(records, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  steps = [r["step"] for r in records]
  fig, ax = plt.subplots(figsize=(5, 3.5))
  ax.plot(steps, [r["accept_adaptive"] for r in records], "o-", label="adaptive (spot-trained)")
  ax.plot(steps, [r["accept_frozen"] for r in records], "s--", label="frozen")
  ax.set_xlabel("RL step (target drifts after each)")
  ax.set_ylabel("acceptance length")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  app.run(main)
