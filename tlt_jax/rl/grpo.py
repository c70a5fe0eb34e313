"""GRPO / DAPO: group advantages, reward shaping and the clipped policy loss.

Host side (numpy, per RL step): `advantages` (group-normalised rewards), `overlong_penalty`
(DAPO's soft length penalty), `keep_groups` (DAPO's dynamic sampling: groups whose rewards are
all equal carry no signal), `token_weights` (how each response token counts in the loss).

Device side (jnp): `policy_loss` over per-token log-probs. Aggregation is decided by the weight
plane, so micro-batches sum to the full batch's loss exactly:
- "token" (DAPO): every response token of the batch weighs 1 / (response tokens in the batch);
- "sequence" (GRPO): every sample weighs 1 / samples, spread over its tokens;
- "constant" (Dr. GRPO): every response token weighs 1 / (samples x the response budget), whatever
  the lengths (no length bias either way).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

AGGREGATIONS = ("token", "sequence", "constant")
ADVANTAGE_STDS = ("sample", "population", "none")


def advantages(rewards_GxN: np.ndarray, std: str = "sample", eps: float = 1e-6) -> np.ndarray:
  """(r - group mean) / (group std + eps): the sample std (N - 1 degrees of freedom, as verl and TRL
  take it; a group of one has none: 0), the population std (N), or no std at all, the mean removed only
  (`std="none"`, Dr. GRPO). A NaN reward (no reward function applies) is left out of its group's mean and
  std and gets advantage 0, as TRL does."""
  if std not in ADVANTAGE_STDS:
    raise ValueError(f"advantage std must be one of {ADVANTAGE_STDS}, got {std!r}")
  r = np.asarray(rewards_GxN, np.float64)
  valid = ~np.isnan(r)
  n = valid.sum(axis=1, keepdims=True)
  centred = np.where(valid, r, 0.0) - np.where(valid, r, 0.0).sum(axis=1, keepdims=True) / np.maximum(n, 1)
  centred = np.where(valid, centred, 0.0)
  if std != "none":
    ddof = int(std == "sample")
    spread = np.sqrt((centred ** 2).sum(axis=1, keepdims=True) / np.maximum(n - ddof, 1)) * (n > ddof)
    centred = centred / (spread + eps)
  return centred.astype(np.float32)


def keep_groups(rewards_GxN: np.ndarray) -> np.ndarray:
  """[G] bool: groups whose rewards (NaN ones left out) are not all equal (DAPO dynamic sampling keeps only these)."""
  r = np.asarray(rewards_GxN, np.float64)
  valid = ~np.isnan(r)
  return np.where(valid, r, -np.inf).max(axis=1) > np.where(valid, r, np.inf).min(axis=1)


def trained_samples(rewards_GxN: np.ndarray, truncated_GxN: np.ndarray, dynamic_sampling: bool,
                    overlong_filter: bool) -> np.ndarray:
  """[G * N] bool: the samples that enter the loss (DAPO dynamic sampling, overlong filtering)."""
  keep = np.ones(np.shape(rewards_GxN), bool)
  if dynamic_sampling:
    keep &= keep_groups(rewards_GxN)[:, None]
  if overlong_filter:
    keep &= ~np.asarray(truncated_GxN, bool)
  return keep.reshape(-1)


def overlong_penalty(lengths: Sequence[int], max_len: int, buffer_len: int) -> np.ndarray:
  """DAPO's soft overlong punishment: 0 up to max_len - buffer_len, then linear down to -1 at max_len."""
  x = np.asarray(lengths, np.float64)
  if buffer_len <= 0:
    return np.zeros_like(x, np.float32)
  return np.clip((max_len - buffer_len - x) / buffer_len, -1.0, 0.0).astype(np.float32)


def token_weights(sample_B: np.ndarray, loss_mask_B: np.ndarray, keep: np.ndarray, aggregation: str,
                  max_len: int = 0) -> np.ndarray:
  """Per-token loss weights for packed rows.

  `sample_B` holds each slot's sample index + 1 (0 = padding), `loss_mask_B` 1 on response tokens,
  `keep[i]` whether sample i enters the loss. Weights sum to 1 over the batch (0 if nothing is kept),
  but with "constant", where a sample of `max_len` (the response budget) tokens weighs 1 / samples.
  """
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
  keep_slot = np.where(sample_B > 0, np.asarray(keep, bool)[np.maximum(sample_B - 1, 0)], False)
  mask = (loss_mask_B > 0) & keep_slot
  if not mask.any():
    return np.zeros(mask.shape, np.float32)
  if aggregation == "token":
    return (mask / mask.sum()).astype(np.float32)
  tokens_per_sample = np.bincount(sample_B[mask], minlength=len(keep) + 1)
  samples = np.count_nonzero(tokens_per_sample)
  if aggregation == "constant":
    if max_len < 1:
      raise ValueError("the constant aggregation (Dr. GRPO) needs the response budget max_len")
    return (mask / (samples * max_len)).astype(np.float32)
  return np.where(mask, 1.0 / (np.maximum(tokens_per_sample[sample_B], 1) * samples), 0.0).astype(np.float32)


def policy_loss(logp_BxT: jax.Array, old_logp_BxT: jax.Array, advantages_BxT: jax.Array, weights_BxT: jax.Array,
                clip_low: float, clip_high: float, ref_logp_BxT: jax.Array | None = None, kl_coef: float = 0.0,
                is_weights_BxT: jax.Array | None = None):
  """Clipped-ratio policy-gradient loss (+ kl_coef * low-variance KL to the reference).

  ratio = exp(logp - old); per token -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A),
  times `is_weights_BxT` where given (truncated importance sampling of the rollout's numerics);
  the KL is the k3 estimator exp(ref - logp) - (ref - logp) - 1 (unbiased, always >= 0).
  Returns (loss, stats) where stats are weighted means (clip fraction, KL, ratio).
  """
  ratio = jnp.exp(logp_BxT - old_logp_BxT)
  unclipped = ratio * advantages_BxT
  clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages_BxT
  pg = -jnp.minimum(unclipped, clipped)
  if is_weights_BxT is not None:
    pg = pg * is_weights_BxT
  loss = (pg * weights_BxT).sum()
  stats = {"pg_loss": loss, "clip_frac": ((clipped < unclipped) * weights_BxT).sum(),
           "ratio": (ratio * weights_BxT).sum()}
  if ref_logp_BxT is not None:
    d = ref_logp_BxT - logp_BxT
    kl = (jnp.exp(d) - d - 1.0) * weights_BxT
    stats["kl"] = kl.sum()
    loss = loss + kl_coef * kl.sum()
  return loss, stats
