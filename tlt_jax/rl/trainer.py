"""The RL loop: TLT rollouts -> rewards -> GRPO/DAPO update, with checkpoints and metrics.

One step:
  1. the next `prompts_per_step` prompts (a seeded permutation per epoch; the position is saved);
  2. `num_samples` responses each from the rollout engine (speculative tail with the drafter and
     the bandit, suffix drafts alone with `rollout.drafter='suffix'`, or plain with
     `rollout.speculative=False`); row keys depend on the running prompt
     count, so a resumed run samples exactly what the uninterrupted one would have;
  3. rewards (+ DAPO's overlong penalty), group advantages, dynamic sampling, overlong filtering;
  4. log-probs of the responses recomputed by the trainer (`old_logp`; rollout numerics never
     enter the loss), then `mini_batches` optimizer updates of micro-batched gradients;
  5. the new policy into the engine (the drafter reads its embedding and lm_head live);
  6. a metrics record; a checkpoint every `checkpoint.every` steps.

Faults: a killed run resumes from its newest complete checkpoint (a damaged one is skipped,
tlt_jax.checkpoint); `run(stop=...)` ends after the step in flight with a checkpoint (SIGTERM /
Ctrl-C in tlt_jax.main); an update with a non-finite loss or gradient is skipped (the actor
leaves params and optimizer state as they were) and counted, and `rl.max_skipped_updates`
skips in a row stop the run with `NonFiniteUpdates`.

Several processes (`jax.distributed`; see README "Multi-host"): every process runs this loop on
the same data. The rollout groups are split among the processes (tlt_jax.drafter.spot), every
process gets every sample, and the actor runs SPMD over the trainer mesh (config.mesh) of all
processes' devices. Process 0 alone writes metrics and the export and creates a missing tiny
policy or drafter (the others wait, then read them); every process takes part in checkpoints.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx
from tqdm import tqdm

from tlt_jax import checkpoint as checkpoint_lib
from tlt_jax import config as config_lib
from tlt_jax import distributed
from tlt_jax import metrics as metrics_lib
from tlt_jax import packing
from tlt_jax import sft
from tlt_jax import sharding
from tlt_jax.drafter import checkpoint as drafter_checkpoint
from tlt_jax.drafter import export
from tlt_jax.drafter.buffer import BufferConfig, DataBuffer
from tlt_jax.drafter.spot import SpotTrainer
from tlt_jax.drafter import train as drafter_train
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import CausalLM, hf
from tlt_jax.rl import actor as actor_lib
from tlt_jax.rl import datasets, grpo, rewards, tokenizer as tokenizer_lib
from tlt_jax.rollout.engine import Engine

_EVAL_OFFSET = 1 << 30  # held-out sampling keys: prompt indices training never reaches


def load_tokenizer(config):
  """The policy's tokenizer, without the policy: prompt files are read, and checked, before the
  policy loads or the tiny policy's SFT warm start runs."""
  if config.policy.path:
    try:
      hf.read_config(config.policy.path)
      tok = hf.load_tokenizer(config.policy.path)
    except (OSError, ValueError) as e:
      raise ValueError(f"config.policy.path={config.policy.path!r}: {e}") from None
    if tok is None:
      raise FileNotFoundError(f"config.policy.path={config.policy.path!r}: no tokenizer "
                              "(tokenizer.json / tokenizer_config.json) to encode prompts with")
    return tok
  policy_dir = os.path.join(config.workdir, "policy")
  if os.path.exists(os.path.join(policy_dir, "config.json")):
    return hf.load_tokenizer(policy_dir)
  return tokenizer_lib.build_tokenizer(config.model.max_position_embeddings)  # what SFT saves with the policy


def load_policy(config) -> tuple[CausalLM, object]:
  """The policy and its tokenizer: `policy.path`, else the tiny world's (SFT into the workdir if absent)."""
  if config.policy.path:
    return hf.from_pretrained(config.policy.path, dtype=config.policy.dtype), hf.load_tokenizer(config.policy.path)
  policy_dir = os.path.join(config.workdir, "policy")
  if _missing(os.path.join(policy_dir, "config.json")):
    if distributed.primary():
      logging.info("no policy in %s: SFT warm start of the tiny policy", policy_dir)
      tok = tokenizer_lib.build_tokenizer(config.model.max_position_embeddings)
      model, losses = sft.warm_start(config, tok)
      logging.info("SFT loss %.3f -> %.3f", losses[0], losses[-1])
      hf.save_pretrained(model, policy_dir, tokenizer=tok)
    distributed.barrier("tiny policy")
    if distributed.primary():
      return model, tok
  return hf.from_pretrained(policy_dir, dtype=config.policy.dtype), hf.load_tokenizer(policy_dir)


def _missing(path: str) -> bool:
  """Whether `path` is absent, as process 0 sees it (the processes must take the same branch)."""
  return distributed.allgather(not os.path.exists(path))[0]


def load_drafter(config, policy: CausalLM, tok) -> Drafter:
  """`drafter.path` or <workdir>/drafter; else a new drafter distilled on the SFT data (warm-up), saved there."""
  path = config.drafter.path or os.path.join(config.workdir, "drafter")
  if not _missing(path):
    return drafter_checkpoint.load_drafter(path, policy.config)
  if config.policy.path:
    raise FileNotFoundError(f"config.drafter.path: no drafter at {path}; warm one up on the policy's own samples "
                            f"with python -m tlt_jax.train_drafter --model={config.policy.path} --output={path}")
  if not distributed.primary():
    distributed.barrier("tiny drafter")
    return drafter_checkpoint.load_drafter(path, policy.config)
  examples = datasets.from_tasks(config.task.family, tok, size=2048, seed=config.seed + 3,
                                 difficulty=sft.difficulty(config))
  sequences = sft.sequences(examples, tok)
  vocab = ()
  if config.drafter.draft_vocab_size:
    try:
      vocab = drafter_train.frequent_tokens(sequences, policy.config.vocab_size, config.drafter.draft_vocab_size)
    except ValueError as e:
      raise ValueError(f"config.drafter.draft_vocab_size: {e}") from None
  drafter = Drafter(policy.config, feature_layers=config.drafter.feature_layers, draft_vocab=vocab,
                    rngs=nnx.Rngs(config.seed))
  d = config.drafter.distill
  result = drafter_train.distill(policy, drafter, sequences, steps=d.steps, batch_rows=d.batch_rows,
                                 row_len=d.row_len, lr=d.learning_rate, seed=config.seed)
  logging.info("drafter warm-up: loss %.3f -> %.3f, top-1 %.2f", result.losses[0], result.losses[-1],
               result.metrics[-1]["top1"])
  drafter_checkpoint.save_drafter(drafter, path)
  distributed.barrier("tiny drafter")
  return drafter


def _prompt_file(config, key: str, tok) -> datasets.Dataset:
  """The prompt file config.<key> names; a missing or unusable one is an error naming the key."""
  path = config_lib.config_value(config, key)
  try:
    return datasets.from_file(path, tok, max_prompt_len=config.data.max_prompt_len, reward=config.data.reward)
  except (OSError, ValueError) as e:
    raise ValueError(f"config.{key}={path!r}: {e}") from None


def load_prompts(config, tok) -> datasets.Dataset:
  if config.data.path:
    return _prompt_file(config, "data.path", tok)
  return datasets.from_tasks(config.task.family, tok, size=config.data.size, seed=config.seed + 2,
                             difficulty=sft.difficulty(config), max_prompt_len=config.data.max_prompt_len,
                             reward=config.data.reward)


def load_eval_prompts(config, tok) -> datasets.Dataset:
  """Held-out prompts: the first eval.size of eval.path, or eval.size procedural problems of a
  seed the training prompts do not use."""
  e = config.eval
  if e.path:
    data = _prompt_file(config, "eval.path", tok)
    return datasets.Dataset(data.examples[:e.size], data.skipped)
  return datasets.from_tasks(config.task.family, tok, size=e.size, seed=config.seed + 1_000_003,
                             difficulty=sft.difficulty(config), max_prompt_len=config.data.max_prompt_len,
                             reward=config.data.reward)


class NonFiniteUpdates(RuntimeError):
  """Too many policy updates in a row had a non-finite loss or gradient."""


class Trainer:
  """Builds everything from a config (see tlt_jax.config) and runs RL steps."""

  def __init__(self, config: ml_collections.ConfigDict, devices: list[jax.Device] | None = None):
    """`devices`: what the rollout runs on (default: all; split into config.rollout.groups groups)."""
    config_lib.check(config)
    self.config = c = config
    tok = load_tokenizer(c)
    self.prompts = load_prompts(c, tok)
    if len(self.prompts) < c.rollout.prompts_per_step:
      raise ValueError(f"{len(self.prompts)} prompts, fewer than config.rollout.prompts_per_step="
                       f"{c.rollout.prompts_per_step}")
    self.eval_prompts = load_eval_prompts(c, tok) if c.eval.every else None
    self.policy, self.tok = load_policy(c)
    strategies = config_lib.strategies(c) if c.rollout.speculative else ()
    eagle = any(not s.suffix for s in strategies)  # else no drafter model: suffix arms or none
    if distributed.multiprocess() and not eagle:
      raise ValueError("config.rollout.speculative=False or rollout.drafter='suffix': a rollout without an EAGLE "
                       "drafter runs in one process only; several processes run the TLT group engines "
                       "(config.rollout.speculative=True, rollout.drafter='eagle')")
    if distributed.multiprocess() and c.eval.every:
      raise ValueError("config.eval.every: held-out evaluation (a plain engine over all devices) runs in one "
                       "process only; set it to 0 for a multi-process run")
    devices = list(devices or jax.devices())
    sampling = config_lib.sampling_params(c, (self.tok.eos_token_id,))
    make_bandit = lambda: config_lib.bandit(c, strategies)
    if eagle:  # TLT: group engines with tail SD + bandit; idle groups train the drafter
      drafter = load_drafter(c, self.policy, self.tok)
      self.drafter_graphdef = nnx.graphdef(drafter)
      self.spot = SpotTrainer(
          self.policy, drafter, config_lib.engine_config(c, strategies, capture_hidden=True), sampling, devices,
          c.rollout.groups, DataBuffer(BufferConfig(**c.drafter.buffer)), config_lib.spot_config(c), make_bandit)
      self.engines = self.spot.engines
    else:  # the baseline, or suffix drafts (no drafter model): one engine, data-parallel over the devices
      self.spot = None
    # Engines data-parallel over all the devices: the baseline's rollouts (as many rows at once as
    # the TLT groups together; with rollout.drafter='suffix', suffix drafts in their tail) and
    # held-out evaluations. Evaluations use the baseline's engine when there is one (compiled for
    # its rollouts anyway), else their own, which decodes the fixed batch without compaction: one
    # bucket to compile. Per-row keys make the samples the same either way.
    mesh = sharding.make_mesh({"data": len(devices)}, devices) if len(devices) > 1 else None
    self._plain_shardings = None if mesh is None else sharding.param_shardings(nnx.state(self.policy), mesh)
    self.plain_engines = []  # they take the policy's params after each update
    if self.spot is None:
      largest = c.rollout.engine.batch_buckets[-1] * c.rollout.groups
      self.engines = [Engine(self.policy, config_lib.engine_config(c, strategies, largest_bucket=largest), sampling,
                             mesh=mesh, bandit=make_bandit() if strategies else None)]
      self.plain_engines = list(self.engines)
    self.eval_engine = None
    if c.eval.every and self.spot is None:
      self.eval_engine = self.engines[0]
    elif c.eval.every:
      rows = c.eval.size * c.eval.num_samples
      self.eval_engine = Engine(self.policy, config_lib.engine_config(c, largest_bucket=1 << (rows - 1).bit_length(),
                                                                      compact=False), sampling, mesh=mesh)
      self.plain_engines.append(self.eval_engine)
    self._groups = self.spot.groups if self.spot is not None else [0]  # the engines' rollout groups
    if distributed.multiprocess():  # the actor runs SPMD over every process's devices
      mesh = sharding.make_mesh({k: c.mesh[k] for k in sharding.MESH_AXES})
      state = nnx.state(self.policy)
      nnx.update(self.policy, jax.device_put(jax.tree.map(np.asarray, state), sharding.param_shardings(state, mesh)))
    self.actor = actor_lib.Actor(self.policy, actor_lib.make_optimizer(**c.rl.optimizer), **c.rl.actor,
                                 mesh=mesh if distributed.multiprocess() else None)
    self.ref_params = jax.tree.map(jnp.copy, self.actor.params) if self.actor.uses_ref else None
    self._push_policy()
    self.step = 0
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
    self.metrics = metrics_lib.Writer(c.workdir, resume_step=self.step if restored is not None else -1) \
        if distributed.primary() else None

  # ---- checkpoints ----

  def _policy_arrays(self) -> dict:
    arrays = {"policy": self.actor.params, "opt_state": self.actor.opt_state}
    if self.ref_params is not None:
      arrays["ref"] = self.ref_params
    return arrays

  def _state(self) -> tuple[dict, dict]:
    """What a checkpoint holds: (arrays, JSON-able metadata). Every process calls it at the same point."""
    local = [(g, e.bandit.state_dict()) for g, e in zip(self._groups, self.engines) if e.bandit is not None]
    bandits = sorted((item for part in distributed.allgather(local) for item in part), key=lambda item: item[0])
    arrays, meta = self._policy_arrays(), {"step": self.step, "skipped_in_a_row": self.skipped_in_a_row,
                                           "bandits": [state for _, state in bandits], "drafter": None}
    if self.spot is not None:
      arrays["drafter"], meta["drafter"] = self.spot.state_dict()
    return arrays, meta

  def _abstract(self, meta: dict) -> dict:
    """The arrays of a checkpoint with metadata `meta`, as shapes to restore them into (the
    drafter's data buffer is as large as the checkpoint's metadata says)."""
    arrays = self._policy_arrays()
    if self.spot is not None:
      arrays["drafter"] = self.spot.abstract_state(meta.get("drafter") or {})
    return arrays

  def _restore(self, step: int, arrays, meta: dict) -> None:
    self.actor.params, self.actor.opt_state = arrays["policy"], arrays["opt_state"]
    self.ref_params = arrays.get("ref")
    if self.spot is not None:
      self.spot.load_state_dict(arrays["drafter"], meta["drafter"])
    for g, engine in zip(self._groups, self.engines):  # every engine has a bandit, or none has
      if engine.bandit is not None:
        engine.bandit.load_state_dict(meta["bandits"][g])
    self.step = self.saved_step = meta["step"]
    self.skipped_in_a_row = meta.get("skipped_in_a_row", 0)
    self._push_policy()
    logging.info("resumed from %s at step %d", os.path.join(self.checkpoints.directory, str(step)), self.step)

  def _push_policy(self) -> None:
    """The actor's params into the rollout (the group engines get copies; the drafter reads them live)."""
    if self.spot is not None:
      self.spot.set_policy_params(self.actor.params)
    if self.plain_engines:
      params = self.actor.params if self._plain_shardings is None else \
          jax.device_put(self.actor.params, self._plain_shardings)
      for engine in self.plain_engines:
        engine.set_params(params)

  def _rollout(self, prompts, offset: int):
    """Samples (prompt_index counted within `prompts`) and the rollout's metrics."""
    g = self.config.rollout.num_samples
    if self.spot is not None:
      return self.spot.rollout(prompts, g, prompt_offset=offset)
    rollout = self.engines[0].generate(prompts, num_samples=g, prompt_offset=offset)
    samples = [dataclasses.replace(s, prompt_index=s.prompt_index - offset) for s in rollout.samples]
    return samples, rollout.metrics.summary()

  # ---- held-out evaluation ----

  def evaluate(self) -> dict[str, float]:
    """Reward of the current policy on the held-out prompts (fixed sampling keys: evaluations at
    different steps differ only by the policy)."""
    start, e = time.perf_counter(), self.config.eval
    examples = list(self.eval_prompts)
    rollout = self.eval_engine.generate([ex.prompt_ids for ex in examples], num_samples=e.num_samples,
                                        prompt_offset=_EVAL_OFFSET)
    samples = rollout.samples
    texts = [self.tok.decode(s.tokens, skip_special_tokens=True) for s in samples]
    truth = [examples[s.prompt_index - _EVAL_OFFSET] for s in samples]
    scores, _ = rewards.score_batch(examples[0].reward, texts, [ex.ground_truth for ex in truth],
                                    [ex.metadata for ex in truth])
    return {"eval/reward": float(scores.mean()), "eval/accuracy": float((scores >= 1.0).mean()),
            "eval/response_length": float(np.median([len(s.tokens) for s in samples])),
            "time/eval_s": time.perf_counter() - start}

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
    c, start = self.config, time.perf_counter()
    indices, offset = self._batch_prompts(self.step)
    examples = [self.prompts[i] for i in indices]
    g = c.rollout.num_samples
    samples, rollout_metrics = self._rollout([ex.prompt_ids for ex in examples], offset)
    rollout_s = time.perf_counter() - start

    texts = [self.tok.decode(s.tokens, skip_special_tokens=True) for s in samples]
    scores, reward_stats = rewards.score_batch(
        examples[0].reward, texts, [examples[s.prompt_index].ground_truth for s in samples],
        [examples[s.prompt_index].metadata for s in samples])
    lengths = np.asarray([len(s.tokens) for s in samples])
    shaped = scores + grpo.overlong_penalty(lengths, c.rollout.sampling.max_new_tokens, c.rl.overlong_buffer)
    adv = grpo.advantages(shaped.reshape(-1, g), normalize_std=c.rl.normalize_std).reshape(-1)
    truncated = np.asarray([s.finish_reason == "length" for s in samples]).reshape(-1, g)
    keep = grpo.trained_samples(shaped.reshape(-1, g), truncated, c.rl.dynamic_sampling, c.rl.overlong_filter)

    t_train = time.perf_counter()
    train_stats = self._update(examples, samples, adv, keep)
    self._push_policy()
    train_s = time.perf_counter() - t_train

    self.step += 1
    record = {"reward/mean": float(scores.mean()), "reward/accuracy": float((scores >= 1.0).mean()),
              "reward/failures": reward_stats["failures"],
              "response_length/median": float(np.median(lengths)),
              "response_length/p90": float(np.percentile(lengths, 90)), "response_length/max": int(lengths.max()),
              "response_length/truncated": int(sum(s.finish_reason == "length" for s in samples)),
              "groups_kept": int(keep.reshape(-1, g).any(axis=1).sum()), "samples_trained": int(keep.sum()),
              **train_stats, **rollout_metrics,
              "time/rollout_s": rollout_s, "time/train_s": train_s, "time/step_s": time.perf_counter() - start}
    if self._eval_due():
      record.update(self.evaluate())
    if self.checkpoints.due(self.step) and self.checkpoints.save(self.step, *self._state()):
      self.saved_step = self.step
    if self.metrics is not None:
      self.metrics.write(self.step, record)
    return record

  def _update(self, examples, samples, adv, keep) -> dict[str, float]:
    """Mini-batch updates over the kept samples (old log-probs of all of them first)."""
    c = self.config
    kept = np.flatnonzero(keep)
    if not len(kept):
      return {"train/updates": 0, "train/skipped_updates": 0}
    order = np.random.default_rng([c.seed, self.step]).permutation(kept)
    sequences = [(examples[s.prompt_index].prompt_ids, s.tokens.tolist()) for s in samples]
    batches = []
    for part in np.array_split(order, min(c.rl.mini_batches, len(order))):
      rows = packing.pack([sequences[i] for i in part], c.rl.row_len, index=True)
      old = self.actor.logprobs(self.actor.params, rows)
      ref = self.actor.logprobs(self.ref_params, rows) if self.ref_params is not None else None
      batches.append(actor_lib.training_batch(rows, adv[part], np.ones(len(part), bool), c.rl.loss_aggregation,
                                              old, ref))
    sums, skipped = {}, 0
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
    return {**{f"train/{k}": v / max(applied, 1) for k, v in sums.items()}, "train/updates": applied,
            "train/skipped_updates": skipped}

  # ---- the loop ----

  def run(self, steps: int | None = None, stop: Callable[[], str | None] = lambda: None) -> list[dict]:
    """Runs until `steps` (default config.steps) steps are done in total; returns this run's records.

    `stop()` is asked before every step; a reason (e.g. "SIGTERM") ends the run there with a
    checkpoint and no export, and is kept in `self.stopped`.
    """
    total = self.config.steps if steps is None else steps
    records, reason = [], None
    if self.step == 0 and self._eval_due() and total > 0:  # the starting point
      self.metrics.write(0, self.evaluate())
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
      self.export()
    return records

  @property
  def checkpoint_path(self) -> str | None:
    """The directory of the newest checkpoint this trainer wrote or restored."""
    return None if self.saved_step is None else os.path.join(self.checkpoints.directory, str(self.saved_step))

  def export(self) -> None:
    """The trained policy as a Hugging Face directory (<workdir>/export/policy) and the drafter as
    an EAGLE checkpoint for serving engines (<workdir>/export/drafter)."""
    out = os.path.join(self.config.workdir, "export")
    policy = nnx.merge(self.actor.graphdef, distributed.to_host(self.actor.params)) if distributed.multiprocess() \
        else self.actor.model()
    if not distributed.primary():
      return
    hf.save_pretrained(policy, os.path.join(out, "policy"), tokenizer=self.tok)
    if self.spot is not None:
      export.export_eagle(policy, nnx.merge(self.drafter_graphdef, self.spot.params), os.path.join(out, "drafter"))

  def close(self) -> None:
    self.checkpoints.close()
    if self.metrics is not None:
      self.metrics.close()
