"""Held-out evaluation: the held-out prompts (`eval.path`, else procedural problems) and the named sets
of `eval.sets`, each sampled its own way and scored by its own reward.

Each set's samples come from fixed keys (prompt indices the training never reaches), so evaluations
at different steps differ only by the policy. A set reports its mean reward with a 95% interval over
prompts (a prompt's samples are not independent), each prompt's mean (for paired comparisons), the
accuracy (reward >= 1 counts as correct), pass@1 and pass@k (the unbiased estimator of Chen et al.
2021: per prompt 1 - C(n - c, k) / C(n, k) of n samples with c correct, averaged over prompts), the
share of responses with an answer line, the median length and the reward calls that failed or timed
out. The held-out set's records are `eval/<key>`, a named set's `eval/<name>/<key>`.

Several processes split each set's prompts in contiguous shares, sample their share on their own
devices (each prompt's keys from its index in the whole set: the samples are those one process would
draw) and gather every score, so that every process holds the same figures.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np
from tqdm import tqdm

from tlt_jax import distributed
from tlt_jax import metrics as metrics_lib
from tlt_jax.rl import datasets, rewards, tasks, tools
from tlt_jax.rl import scorer as scorer_lib
from tlt_jax.rollout.base import BaseRollout

OFFSET = 1 << 30  # held-out sampling keys: prompt indices training never reaches


@dataclasses.dataclass
class EvalSet:
  """One evaluation set and what samples it on this process's devices."""

  name: str  # "" for the held-out set
  examples: list[datasets.Example]
  num_samples: int
  k: int
  rollout: BaseRollout

  def key(self, what: str) -> str:
    return f"eval/{self.name}/{what}" if self.name else f"eval/{what}"


def pass_at_k(n: int, correct: int, k: int) -> float:
  """The unbiased estimate of the chance that at least one of k of the n samples is correct."""
  if n - correct < k:
    return 1.0
  return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def _share(n: int) -> tuple[int, int]:
  """This process's contiguous share [start, end) of n prompts."""
  p, count = jax.process_index(), jax.process_count()
  return n * p // count, n * (p + 1) // count


def evaluate(s: EvalSet, scorer: scorer_lib.Scorer, tok, state: rewards.TrainerState | None = None) -> dict:
  """The set's records (module docstring). Every process calls it at the same point."""
  start_s = time.perf_counter()
  start, end = _share(len(s.examples))
  examples = s.examples[start:end]
  local, failed, error = [], 0.0, None
  if examples:
    with tqdm(total=len(examples) * s.num_samples, desc=f"evaluation {s.name or 'held-out'}", unit="response",
              leave=False, disable=not distributed.primary()) as bar:
      samples, _ = s.rollout.generate([ex.prompt_ids for ex in examples], num_samples=s.num_samples,
                                      prompt_offset=OFFSET + start, on_progress=lambda rows, _: bar.update(rows))
    texts = [tok.decode(x.answer, skip_special_tokens=True) for x in samples]  # the last turn, with tools
    items = [examples[x.prompt_index].item(t, x.answer.tolist(), tools.trajectory(x), tools.conversation(x, tok))
             for x, t in zip(samples, texts)]
    try:
      scores, stats = scorer.score(examples[0].reward, items, what=f"in evaluation {s.name or 'held-out'!r}",
                                   state=state)
    except rewards.RewardError as e:  # raised on every process below (the others would wait for this one)
      error = e
    else:
      failed = stats["failures"] + stats["timeouts"]
      local = [(start + x.prompt_index, float(score), tasks.extract_answer(t) is not None, len(x.tokens))
               for x, t, score in zip(samples, texts, scores)]
  parts = distributed.allgather((local, failed, None if error is None else str(error)))
  errors = [why for _, _, why in parts if why]
  if error is not None:
    raise error
  if errors:
    raise rewards.RewardError(errors[0])
  rows = sorted(r for part, _, _ in parts for r in part)
  failed = sum(f for _, f, _ in parts)
  prompt, score, answered, length = (np.asarray(column) for column in zip(*rows))
  scored = ~np.isnan(score)  # NaN: no reward function applies (TRL's None), out of the means
  per_prompt = metrics_lib.group_means(score[scored], prompt[scored].tolist())
  # One entry per prompt, in order (None: no response scorable), so that evaluations pair prompt by prompt.
  by_prompt = [None if np.isnan(score[prompt == i]).all() else round(float(np.nanmean(score[prompt == i])), 4)
               for i in sorted(set(prompt.tolist()))]
  correct = [int((score[prompt == i] >= 1.0).sum()) for i in sorted(set(prompt.tolist()))]
  k = s.k or s.num_samples
  return {s.key("reward"): float(score[scored].mean()) if scored.any() else math.nan,
          s.key("reward_ci95"): metrics_lib.ci95(per_prompt),
          s.key("prompt_rewards"): by_prompt,
          s.key("accuracy"): float((score[scored] >= 1.0).mean()) if scored.any() else math.nan,
          s.key("pass@1"): float(np.mean([c / s.num_samples for c in correct])),
          s.key(f"pass@{k}"): float(np.mean([pass_at_k(s.num_samples, c, k) for c in correct])),
          s.key("answered"): float(answered.mean()), s.key("response_length"): float(np.median(length)),
          s.key("reward_failures"): float(failed),
          s.key("time_s") if s.name else "time/eval_s": time.perf_counter() - start_s}
