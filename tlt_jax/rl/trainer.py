"""The RL loop: TLT rollouts -> rewards -> GRPO/DAPO update, with checkpoints and metrics.

One step:
  1. the next `prompts_per_step` prompts (a seeded permutation per epoch; the position is saved);
  2. `num_samples` responses each from the rollout (tlt_jax.rl.rollouts: TLT group engines with the
     speculative tail, the drafter trained on idle groups; suffix drafts alone with
     `rollout.drafter='suffix'`; or plain with `rollout.speculative=False`); row keys depend on the
     running prompt count, so a resumed run samples exactly what the uninterrupted one would have;
  3. rewards (+ DAPO's overlong penalty), group advantages, dynamic sampling, overlong filtering;
  4. the responses' old log-probs (`rl.old_logp`): the rollout's own where they are the trainer's numbers
     (float32), else recomputed by the trainer, their gap to the rollout's logged (`mismatch/*`, verl's
     metrics; rollout numerics then enter the loss only through `rl.rollout_correction`'s importance weights
     and rejections, tlt_jax.rl.corrections); then `mini_batches` optimizer updates of micro-batched gradients;
  5. the new policy into the rollouts (the drafter reads its embedding and lm_head live);
  6. a metrics record (`rollout/compilations`: executables compiled during the rollout, the first
     step's engines' and drafter trainer's; none after it); a checkpoint every `checkpoint.every` steps.

Faults: a killed run resumes from its newest complete checkpoint (a damaged one is skipped,
tlt_jax.checkpoint); `run(stop=...)` ends after the step in flight with a checkpoint (SIGTERM /
Ctrl-C in tlt_jax.main); an update with a non-finite loss or gradient is skipped (the actor
leaves params and optimizer state as they were) and counted, and `rl.max_skipped_updates`
skips in a row stop the run with `NonFiniteUpdates`.

Several processes (`jax.distributed`; see README "Multi-host"): every process runs this loop on
the same data. The rollout groups are split among the processes (tlt_jax.rollout.tlt), every
process gets every sample, and the actor runs SPMD over the trainer mesh (config.mesh) of all
processes' devices. Process 0 alone writes metrics and the export; every process takes part in
checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx
from tqdm import tqdm

from tlt_jax import checkpoint as checkpoint_lib
from tlt_jax import distributed
from tlt_jax import memory
from tlt_jax import metrics as metrics_lib
from tlt_jax import packing
from tlt_jax import sharding
from tlt_jax.drafter import export
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import CausalLM, hf, lora
from tlt_jax.rl import actor as actor_lib
from tlt_jax.rl import builders, datasets, evaluation, grpo, rewards, rollouts, scorer, tools
from tlt_jax.rl import checks
from tlt_jax.rollout import profile

def recomputes_old_logp(config) -> bool:
  """Whether the trainer recomputes the old log-probs (`rl.old_logp`; "auto": unless the rollout's are its
  own numbers: float32 compute, and the sampling distribution is softmax(logits / T), no top-k / top-p; and
  no rollout correction, which weighs the two)."""
  if config.rl.old_logp != "auto":
    return config.rl.old_logp == "recompute"
  s = config.rollout.sampling
  own = config.policy.dtype == "float32" and not s.top_k and s.top_p >= 1
  return not own or builders.rollout_correction(config).enabled


def make_actor(config: ml_collections.ConfigDict, policy: CausalLM,
               devices: Sequence[jax.Device] | None = None) -> actor_lib.Actor:
  """The actor over the trainer mesh (`config.mesh` over `devices`, default every process's): the policy's
  params laid out on it (in place; FSDP / tensor-parallel by the sharding rules), its micro-batches split over
  its batch axes. On one device, as the policy is."""
  devices = jax.devices() if devices is None else list(devices)
  mesh = sharding.make_mesh({k: config.mesh[k] for k in sharding.MESH_AXES}, devices) if len(devices) > 1 else None
  if mesh is not None:
    state = nnx.state(policy)
    if not sharding.abstract(state):  # each process holds the whole policy: its host copy goes onto the mesh
      state = jax.tree.map(np.asarray, state)
    nnx.update(policy, sharding.place(state, sharding.param_shardings(state, mesh)))
  optimizer = {k: v for k, v in config.rl.optimizer.items() if k != "max_grad_norm"}
  return actor_lib.Actor(policy, actor_lib.make_optimizer(**optimizer), **config.rl.actor,
                         max_grad_norm=config.rl.optimizer.max_grad_norm, loss=builders.objective(config),
                         temperature=config.rollout.sampling.temperature, seed=config.seed, mesh=mesh)


class NonFiniteUpdates(RuntimeError):
  """Too many policy updates in a row had a non-finite loss or gradient."""


class Trainer:
  """Runs RL steps (module docstring) with a rollout for the steps and one for held-out evaluations."""

  def __init__(self, config: ml_collections.ConfigDict, policy: CausalLM, tokenizer, drafter: Drafter | None,
               prompts: datasets.Dataset, eval_sets: dict[str, datasets.Dataset] | None = None,
               devices: Sequence[jax.Device] | None = None):
    """Builds the rollouts (tlt_jax.rl.rollouts), the actor and the checkpoints, and resumes from
    the newest checkpoint in <workdir>/checkpoints when there is one. tlt_jax.rl.bootstrap.load
    makes the arguments after `config` from it.

    Args:
      config: the run's config (tlt_jax.config).
      policy: the initial policy (a restored checkpoint replaces its params).
      tokenizer: the policy's tokenizer.
      drafter: the EAGLE drafter the rollout speculates with and trains; None when it uses none.
      prompts: the training prompts.
      eval_sets: with `eval.every`, the held-out prompts (name "") and `eval.sets`' (bootstrap.load_eval_sets).
      devices: what the rollouts run on (default: all; split into config.rollout.groups groups).
    """
    checks.check(config)
    self.config = c = config
    eval_sets = eval_sets or {}
    if c.eval.every and set(eval_sets) != {"", *c.eval.sets}:
      raise ValueError(f"config.eval.every: held-out evaluations need the held-out prompts and every set of "
                       f"config.eval.sets ({sorted(c.eval.sets)}); got {sorted(eval_sets)}")
    self.policy, self.tok, self.prompts = policy, tokenizer, prompts
    self.scorer = scorer.Scorer(c.data.reward_workers, c.data.reward_timeout_s, c.data.reward_max_failures)
    # The rollouts hold the policy in its compute dtype (a bfloat16 copy of float32 masters), LoRA adapters
    # folded into the weights.
    graphdef, state = nnx.split(lora.merged(policy))
    rollout_policy = nnx.merge(graphdef, actor_lib.rollout_copy(state, policy.dtype))
    self.turns = builders.tool_turns(c, tokenizer)  # None without rollout.tools
    self.rollout, held_out = rollouts.make(c, rollout_policy, drafter, tokenizer, devices or jax.devices(), self.turns)
    self.eval_sets = []
    for name, data in eval_sets.items():
      s = c.eval.sets[name] if name else ml_collections.ConfigDict(dict(num_samples=c.eval.num_samples, k=0,
                                                                        temperature=-1.0))
      rollout = held_out if not name else rollouts.make_eval(c, rollout_policy, tokenizer,
                                                             len(data) * s.num_samples, s.temperature, self.turns)
      self.eval_sets.append(evaluation.EvalSet(name, list(data), s.num_samples, s.k, rollout))
    # Each takes the policy's params after an update (once: the rollout may be the evaluations' too).
    self._rollouts = list({id(r): r for r in [self.rollout, *(s.rollout for s in self.eval_sets)]}.values())
    self.actor = make_actor(c, self.policy)
    self.ref_params = jax.tree.map(jnp.copy, self.actor.params) if self.actor.uses_ref else None
    trained, frozen = (sum(x.size for x in jax.tree.leaves(t)) for t in (self.actor.params, self.actor.frozen))
    logging.info("training %d parameters (%.2f%% of the policy's%s); optimizer state %.3f GB", trained,
                 100 * trained / (trained + frozen), "; LoRA adapters" if self.actor.lora else "",
                 sum(x.nbytes for x in jax.tree.leaves(self.actor.opt_state)) / 1e9)
    self.recompute_old_logp = recomputes_old_logp(c)
    self.peaks = memory.Peaks()  # each phase's peak memory, into each step's record
    self.correction = builders.rollout_correction(c)
    # A LoRA run's checkpoints hold its adapters alone: the base model they were trained on is checked on resume.
    self.lora = None
    if self.actor.lora is not None:
      base = c.policy.path or os.path.join(c.workdir, "policy")
      self.lora = {**dataclasses.asdict(self.actor.lora), "base": os.path.abspath(base),
                   "base_sha256": lora.fingerprint(base)}
    logging.info("old log-probs: %s (config.rl.old_logp=%s)", "recomputed by the trainer" if self.recompute_old_logp
                 else "the rollout's (float32: the trainer's own)", c.rl.old_logp)
    self._push_policy()
    self.step = 0
    self._rolled_out = False  # whether this process has run a step's rollout (compiling every executable)
    self.stopped: str | None = None  # why the last run() ended early
    self.skipped_in_a_row = 0  # policy updates skipped for a non-finite loss / gradient, since the last good one
    self.checkpoints = checkpoint_lib.Checkpoints(os.path.join(c.workdir, "checkpoints"), c.checkpoint.every,
                                                  c.checkpoint.keep)
    self.saved_step = None
    restored = self.checkpoints.restore_latest(self._abstract)
    if restored is not None:
      self._restore(*restored)
    # Nothing restored: records left by a run killed before its first checkpoint (its step-0
    # evaluation) go too.
    self.metrics = None
    if distributed.primary():
      w = c.logging
      run = metrics_lib.wandb_run(c.workdir, w.wandb_project, w.wandb_entity, w.wandb_run, c.to_dict()) \
          if w.wandb else None
      self.metrics = metrics_lib.Writer(c.workdir, resume_step=self.step if restored is not None else -1, wandb=run,
                                        tools=self.turns is not None)

  # ---- checkpoints ----

  def _policy_arrays(self) -> dict:
    arrays = {"policy": self.actor.params, "opt_state": self.actor.opt_state}
    if self.ref_params is not None:
      arrays["ref"] = self.ref_params
    return arrays

  def _state(self) -> tuple[dict, dict]:
    """What a checkpoint holds: (arrays, JSON-able metadata). Every process calls it at the same point."""
    arrays, meta = self.rollout.state_dict()
    return {**self._policy_arrays(), **arrays}, {"step": self.step, "skipped_in_a_row": self.skipped_in_a_row,
                                                 "scan_layers": self.policy.config.scan_layers, "lora": self.lora,
                                                 **meta}

  def _abstract(self, meta: dict) -> dict:
    """The arrays of a checkpoint with metadata `meta`, as shapes to restore them into (the
    drafter's data buffer is as large as the checkpoint's metadata says). The policy's layers are
    in the form they were saved in (stacked or one by one; checkpoints from before the scanned
    form hold no `scan_layers`: unrolled); another form is refused, naming the key that reads it. So is a
    LoRA run's checkpoint for a run without LoRA or another rank, and one trained on other base weights."""
    saved = meta.get("scan_layers", False)
    if saved != self.policy.config.scan_layers:
      raise ValueError(f"it holds the policy's layers {'scanned' if saved else 'unrolled'}; resume it with "
                       f"--config.policy.scan_layers={saved}")
    saved, now = meta.get("lora"), self.lora
    if (saved or {}).get("rank") != (now or {}).get("rank"):
      raise ValueError(f"it holds {'a full policy' if not saved else 'LoRA adapters of rank %d' % saved['rank']}; "
                       f"resume it with --config.policy.lora.rank={saved['rank'] if saved else 0}")
    if saved and saved["base_sha256"] != now["base_sha256"]:
      raise ValueError(f"its LoRA adapters were trained on other base weights: {saved['base']} (sha256 "
                       f"{saved['base_sha256'][:12]}), not config.policy.path's (sha256 {now['base_sha256'][:12]})")
    return {**self._policy_arrays(), **self.rollout.abstract_state(meta)}

  def _restore(self, step: int, arrays, meta: dict) -> None:
    self.actor.params, self.actor.opt_state = arrays["policy"], arrays["opt_state"]
    self.ref_params = arrays.get("ref")
    self.rollout.load_state_dict(arrays, meta)
    self.step = self.saved_step = meta["step"]
    self.skipped_in_a_row = meta.get("skipped_in_a_row", 0)
    self._push_policy()
    logging.info("resumed from %s at step %d", os.path.join(self.checkpoints.directory, str(step)), self.step)

  def _push_policy(self) -> None:
    """The actor's params into the rollouts, cast once to the compute dtype (gathered once to the host
    when several processes hold their shards)."""
    params = self.actor.rollout_params(self.policy.dtype)
    if distributed.multiprocess():
      params = distributed.to_host(params)
    for rollout in self._rollouts:
      rollout.set_policy_params(params)

  # ---- held-out evaluation ----

  def evaluate(self) -> dict[str, float | list[float]]:
    """Every evaluation set's records (tlt_jax.rl.evaluation)."""
    state = rewards.TrainerState(self.step, self.config.steps)
    return {k: v for s in self.eval_sets for k, v in evaluation.evaluate(s, self.scorer, self.tok, state).items()}

  def _eval_due(self) -> bool:
    every = self.config.eval.every
    return bool(every) and (self.step % every == 0 or self.step == self.config.steps)

  # ---- one step ----

  def _batch_prompts(self, step: int) -> tuple[list[int], int]:
    """Dataset indices of step `step`'s prompts and the running count of prompts before them."""
    n, p = len(self.prompts), self.config.rollout.prompts_per_step
    first = step * p
    indices = []
    for k in range(first, first + p):
      epoch, at = divmod(k, n)
      indices.append(int(np.random.default_rng([self.config.seed, epoch]).permutation(n)[at]))
    return indices, first

  def run_step(self) -> dict[str, float]:
    """One RL step (module docstring); returns its metrics record (also written to metrics.jsonl)."""
    c, start = self.config, time.perf_counter()
    indices, offset = self._batch_prompts(self.step)
    examples = [self.prompts[i] for i in indices]
    g = c.rollout.num_samples
    memory.release_host()  # what the last step's evaluation and checkpoint freed
    with profile.count_compilations() as compiled, self.peaks.phase("rollout"):  # compiles at the first step only
      samples, rollout_metrics = self.rollout.generate([ex.prompt_ids for ex in examples], g, prompt_offset=offset)
    rollout_s = time.perf_counter() - start
    if compiled and self._rolled_out:  # this process's first rollout compiles every executable; later ones none
      logging.warning("%d executables compiled during step %d's rollout: %s", len(compiled), self.step + 1,
                      sorted(set(compiled)))
    self._rolled_out = True

    texts = [self.tok.decode(s.answer, skip_special_tokens=True) for s in samples]  # the last turn, with tools
    logged_columns = {}  # what TRL-style reward functions log with log_extra: columns of completions.jsonl
    items = [examples[s.prompt_index].item(t, s.answer.tolist(), tools.trajectory(s), tools.conversation(s, self.tok))
             for s, t in zip(samples, texts)]
    per_function = []
    with self.peaks.phase("rewards"):
      scores, reward_stats = self.scorer.score(examples[0].reward, items, what=f"in step {self.step + 1}",
                                               state=rewards.TrainerState(self.step, c.steps), columns=logged_columns,
                                               per_function=per_function)
    lengths = np.asarray([len(s.tokens) for s in samples])
    penalty = grpo.overlong_penalty(lengths, c.rollout.sampling.max_new_tokens, c.rl.overlong_buffer)
    shaped = scores + penalty
    if c.rl.reward_aggregation == "normalize_then_sum":  # the overlong penalty: one more function, weight 1
      values, weights = per_function[0]
      adv = grpo.normalize_then_sum(np.concatenate([values, penalty[None]]) if c.rl.overlong_buffer else values,
                                    np.append(weights, 1.0) if c.rl.overlong_buffer else weights, g, c.rl.advantage_eps)
    else:
      adv = grpo.advantages(shaped.reshape(-1, g), c.rl.advantage_std, c.rl.advantage_eps).reshape(-1)
    truncated = np.asarray([s.finish_reason == "length" for s in samples]).reshape(-1, g)
    keep = grpo.trained_samples(shaped.reshape(-1, g), truncated, c.rl.dynamic_sampling, c.rl.overlong_filter)

    t_train = time.perf_counter()
    reward_s = t_train - start - rollout_s
    for rollout in self._rollouts:  # their copy of the policy is stale from here: its memory goes to the update
      rollout.release_policy_params()
    memory.release_host()  # what the rollout freed, before the update stands on it
    train_stats = self._update(examples, samples, adv, keep)
    memory.release_host()  # what the update freed, before the next phases
    with self.peaks.phase("push"):
      self._push_policy()
    train_s = time.perf_counter() - t_train

    self.step += 1
    scored = scores[~np.isnan(scores)]  # NaN: no reward function applies (TRL's None), out of the means
    record = {"reward/mean": reward_stats["mean"],
              "reward/accuracy": float((scored >= 1.0).mean()) if len(scored) else math.nan,
              **{f"reward/{k}": v for k, v in reward_stats.items() if k != "mean"},
              "response_length/median": float(np.median(lengths)),
              "response_length/p90": float(np.percentile(lengths, 90)), "response_length/max": int(lengths.max()),
              "response_length/truncated": int(sum(s.finish_reason == "length" for s in samples)),
              "groups_kept": int(keep.reshape(-1, g).any(axis=1).sum()), "samples_trained": int(keep.sum()),
              **tools.stats(samples), **train_stats, **rollout_metrics, "rollout/compilations": len(compiled),
              "time/rollout_s": rollout_s, "time/reward_s": reward_s, "time/train_s": train_s,
              "time/step_s": time.perf_counter() - start}
    if self._eval_due():
      with self.peaks.phase("eval"):
        record.update(self.evaluate())
    if self.checkpoints.due(self.step):
      with self.peaks.phase("checkpoint"):
        if self.checkpoints.save(self.step, *self._state()):
          self.saved_step = self.step
    record.update(self.peaks.record())
    if self.metrics is not None:
      self.metrics.write_completions(self.step, [
          {**{name: column[i] for name, column in logged_columns.items()}, "prompt": s.prompt_index,
           "sample": s.sample_index,
           "prompt_text": self.tok.decode(examples[s.prompt_index].prompt_ids, skip_special_tokens=True),
           "completion": self.tok.decode(s.tokens, skip_special_tokens=True),
           "reward": None if np.isnan(scores[i]) else float(scores[i]),
           "advantage": float(adv[i]), "length": int(lengths[i]), "finish_reason": s.finish_reason,
           "trained": bool(keep.reshape(-1)[i])} for i, s in enumerate(samples[:c.logging.completions_per_step])])
      self.metrics.write(self.step, record)
      if self.turns is not None:
        self.metrics.write_calls(self.step, samples)
    return record

  def _update(self, examples, samples, adv, keep) -> dict[str, float]:
    """Mini-batch updates over the kept samples (old log-probs of all of them first, recomputed or the
    rollout's)."""
    c = self.config
    kept = np.flatnonzero(keep)
    if not len(kept):
      return {"train/updates": 0, "train/skipped_updates": 0, "time/old_logp_s": 0.0, "time/update_s": 0.0}
    start = time.perf_counter()
    order = np.random.default_rng([c.seed, self.step]).permutation(kept)
    sequences = [(examples[s.prompt_index].prompt_ids, s.tokens.tolist(),
                  *(() if s.tool_mask is None else (~s.tool_mask,))) for s in samples]  # tool tokens: no loss
    parts = []
    with self.peaks.phase("old_logp"):
      for part in np.array_split(order, min(c.rl.mini_batches, len(order))):
        rows = packing.pack([sequences[i] for i in part], c.rl.row_len, index=True)
        rollout_logp = actor_lib.response_plane(rows, [samples[i].own(samples[i].logprobs) for i in part])
        old = self.actor.logprobs(self.actor.params, rows) if self.recompute_old_logp else rollout_logp
        ref = self.actor.logprobs(self.ref_params, rows) if self.ref_params is not None else None
        parts.append((part, rows, rollout_logp, old, ref))
      is_weights, loss_masks, mismatch = self._correct(parts)
    batches = []
    for (part, rows, rollout_logp, old, ref), w, loss_mask in zip(parts, is_weights, loss_masks):
      rows = np.concatenate([rows[:3], loss_mask[None], rows[4:]])
      batches.append(actor_lib.training_batch(rows, adv[part], np.ones(len(part), bool), c.rl.loss.aggregation,
                                              old, ref, w, c.rollout.sampling.max_new_tokens, rollout_logp))
    times = {"time/old_logp_s": time.perf_counter() - start}  # and the reference's, with a KL
    sums, skipped = {}, 0
    with self.peaks.phase("update"):  # every micro-batch's gradient and the optimizer's update
      for batch in batches:
        stats = self.actor.update(batch)
        if stats.pop("skipped"):
          skipped += 1
          self.skipped_in_a_row += 1
          logging.warning("step %d: skipped a policy update with a non-finite loss or gradient (%s); %d in a row",
                          self.step + 1, ", ".join(f"{k}={v:.4g}" for k, v in stats.items()), self.skipped_in_a_row)
          if self.skipped_in_a_row >= c.rl.max_skipped_updates:
            raise NonFiniteUpdates(
                f"step {self.step + 1}: {self.skipped_in_a_row} policy updates in a row had a non-finite loss or "
                f"gradient (config.rl.max_skipped_updates={c.rl.max_skipped_updates}); stopping. The last checkpoint "
                f"(step {self.saved_step}) holds the params from before them: lower rl.optimizer.learning_rate, check "
                "the data and rewards, then resume")
          continue
        self.skipped_in_a_row = 0
        for k, v in stats.items():
          sums[k] = sums.get(k, 0.0) + v
    applied = len(batches) - skipped
    times["time/update_s"] = time.perf_counter() - start - times["time/old_logp_s"]
    return {**{f"train/{k}": v / max(applied, 1) for k, v in sums.items()}, "train/updates": applied,
            "train/skipped_updates": skipped, **mismatch, **times}

  def _correct(self, parts):
    """The rollout correction over the whole step's mini-batches (one batch, as verl computes it): each part's
    importance weights (None: off) and loss mask (rejected tokens out), and the mismatch metrics; nothing when
    the old log-probs are the rollout's own."""
    if not self.recompute_old_logp:
      return [None] * len(parts), [rows[3] for _, rows, *_ in parts], {}
    offsets = np.cumsum([0] + [len(part) for part, *_ in parts])
    rows = np.concatenate([np.concatenate([r[:4], np.where(r[4:] > 0, r[4:] + o, 0)]) for (_, r, *_), o
                           in zip(parts, offsets)], axis=1)
    old, rollout = (np.concatenate([p[i] for p in parts]) for i in (3, 2))
    weights, loss_mask, metrics = self.correction.apply(old, rollout, rows)
    ends = np.cumsum([r.shape[1] for _, r, *_ in parts])[:-1]
    return ([None] * len(parts) if weights is None else np.split(weights, ends)), np.split(loss_mask, ends), metrics

  # ---- the loop ----

  def run(self, steps: int | None = None, stop: Callable[[], str | None] = lambda: None) -> list[dict]:
    """Runs until `steps` (default config.steps) steps are done in total; returns this run's records.

    `stop()` is asked before every step; a reason (e.g. "SIGTERM") ends the run there with a
    checkpoint and no export, and is kept in `self.stopped`.
    """
    total = self.config.steps if steps is None else steps
    records, reason = [], None
    if self.step == 0 and self._eval_due() and total > 0:  # the starting point (every process evaluates its share)
      with self.peaks.phase("eval"):
        record = self.evaluate()
      record.update(self.peaks.record())
      if self.metrics is not None:
        self.metrics.write(0, record)
    with tqdm(total=total, initial=self.step, desc="rl", unit="step", disable=not distributed.primary()) as bar:
      # Several processes stop together when any is asked to (else the others would wait for it).
      while self.step < total and not (reason := next(filter(None, distributed.allgather(stop())), None)):
        record = self.run_step()
        records.append(record)
        bar.set_postfix(reward=f"{record['reward/mean']:.3f}", len=f"{record['response_length/median']:.0f}",
                        step_s=f"{record['time/step_s']:.1f}", refresh=False)
        bar.update(1)
    if self.saved_step != self.step:
      self.checkpoints.save(self.step, *self._state(), force=True)
      self.saved_step = self.step
    self.checkpoints.wait()
    self.stopped = reason if self.step < total else None
    if not self.stopped:
      memory.release_host()  # what the checkpoint's host copies freed, before the export's own
      self.export()
    return records

  @property
  def checkpoint_path(self) -> str | None:
    """The directory of the newest checkpoint this trainer wrote or restored."""
    return None if self.saved_step is None else os.path.join(self.checkpoints.directory, str(self.saved_step))

  def export(self) -> None:
    """The trained policy as a Hugging Face directory (<workdir>/export/policy, in `policy.export_dtype`:
    by default the dtype of the checkpoint it started from; a LoRA run's merged, and its adapter in PEFT's
    format in <workdir>/export/adapter) and the drafter as an EAGLE checkpoint for serving engines
    (<workdir>/export/drafter)."""
    out = os.path.join(self.config.workdir, "export")
    policy = nnx.merge(self.actor.graphdef, *distributed.to_host((self.actor.params, self.actor.frozen))) \
        if distributed.multiprocess() else self.actor.model()
    if not distributed.primary():
      return
    p = self.config.policy
    if self.lora is not None:
      lora.save_peft(policy, os.path.join(out, "adapter"), base_model=self.lora["base"])
      if lora.is_identity(policy):
        logging.warning("%s: every lora_B is zero (no update trained the adapter): it equals the base model",
                        os.path.join(out, "adapter"))
      policy = lora.merged(policy)
    dtype = p.export_dtype or (hf.checkpoint_dtype(p.path) if p.path else p.dtype)
    hf.save_pretrained(policy, os.path.join(out, "policy"), tokenizer=self.tok, dtype=dtype)
    drafter = self.rollout.drafter_model()
    if drafter is not None:
      export.export_eagle(policy, drafter, os.path.join(out, "drafter"))

  def close(self, quiet: bool = False) -> None:
    """Waits for the checkpoints and the metrics to be written; stops the reward workers. Every part is
    closed even when one fails (a full disk fails every write); the first failure is raised after, unless
    `quiet` (after a failure already reported)."""
    parts = [rollout.close for rollout in self._rollouts] + [self.scorer.close, self.checkpoints.close]
    if self.turns is not None:
      parts.append(self.turns.close)
    if self.metrics is not None:
      parts.append(self.metrics.close)
    first = None
    for close in parts:
      try:
        close()
      except Exception as e:  # pylint: disable=broad-except
        first = first or e
        logging.debug("closing %s failed", close, exc_info=True)
    if first is not None and not quiet:
      raise first
