"""GRPO / DAPO: group advantages, reward shaping and the clipped policy loss.

Host side (numpy, per RL step): `advantages` (group-normalised rewards), `overlong_penalty`
(DAPO's soft length penalty), `keep_groups` (DAPO's dynamic sampling: groups whose rewards are
all equal carry no signal), `token_weights` (how each response token counts in the loss).

Device side (jnp): `policy_loss` over per-token log-probs. Aggregation is decided by the weight
plane, so micro-batches sum to the full batch's loss exactly:
- "token" (DAPO): every response token of the batch weighs 1 / (response tokens in the batch);
- "sequence" (GRPO): every sample weighs 1 / samples, spread over its tokens;
- "constant" (Dr. GRPO): every response token weighs 1 / (samples x the response budget), whatever
  the lengths (no length bias either way);
- "sequence_sum" (TRL's luspo): every response token weighs 1 / samples (a sample's loss scales with its length).
The per-token objectives (clip, CISPO, SAPO, VESPO; token or sequence ratios; masks) are `Objective`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax import fields

AGGREGATIONS = ("token", "sequence", "constant", "sequence_sum")
LOSSES = ("clip", "cispo", "sapo", "vespo")
IMPORTANCE_LEVELS = ("token", "sequence")
ADVANTAGE_STDS = ("sample", "population", "batch", "none")
REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def advantages(rewards_GxN: np.ndarray, std: str = "sample", eps: float = 1e-6) -> np.ndarray:
  """(r - group mean) / (group std + eps): the sample std (N - 1 degrees of freedom, as verl and TRL
  take it; a group of one has none: 0), the population std (N), the sample std of the whole batch's rewards
  (`std="batch"`, TRL's scale_rewards="batch"), or no std at all, the mean removed only (`std="none"`, Dr.
  GRPO). A NaN reward (no reward function applies) is left out of its group's mean and std and gets advantage 0,
  as TRL does."""
  if std not in ADVANTAGE_STDS:
    raise ValueError(f"advantage std must be one of {ADVANTAGE_STDS}, got {std!r}")
  r = np.asarray(rewards_GxN, np.float64)
  valid = ~np.isnan(r)
  n = valid.sum(axis=1, keepdims=True)
  centred = np.where(valid, r, 0.0) - np.where(valid, r, 0.0).sum(axis=1, keepdims=True) / np.maximum(n, 1)
  centred = np.where(valid, centred, 0.0)
  if std == "batch":  # the sample std of all the batch's rewards
    count = valid.sum()
    spread = np.nanstd(np.where(valid, r, np.nan), ddof=1) if count > 1 else 0.0
    centred = centred / (spread + eps)
  elif std != "none":
    ddof = int(std == "sample")
    spread = np.sqrt((centred ** 2).sum(axis=1, keepdims=True) / np.maximum(n - ddof, 1)) * (n > ddof)
    centred = centred / (spread + eps)
  return centred.astype(np.float32)


def normalize_then_sum(values_KxGN: np.ndarray, weights_K: np.ndarray, group: int, eps: float = 1e-6) -> np.ndarray:
  """[G * N] advantages of several reward functions normalised one by one (GDPO; TRL's
  multi_objective_aggregation="normalize_then_sum"): each function's group-normalised values (sample std), summed
  with their weights, then normalised over the batch (its mean and sample std). A sample no function scores
  (all NaN) gets advantage 0."""
  values = np.asarray(values_KxGN, np.float64)
  each = np.stack([advantages(v.reshape(-1, group), "sample", eps).reshape(-1) for v in values])
  summed = (np.asarray(weights_K, np.float64)[:, None] * each).sum(axis=0)
  summed[np.isnan(values).all(axis=0)] = np.nan
  scored = summed[~np.isnan(summed)]
  spread = scored.std(ddof=1) if len(scored) > 1 else 0.0
  return np.nan_to_num((summed - (scored.mean() if len(scored) else 0.0)) / (spread + eps)).astype(np.float32)


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
  but with "constant", where a sample of `max_len` (the response budget) tokens weighs 1 / samples, and
  "sequence_sum", where each sample weighs its length / samples.
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
  if aggregation == "sequence_sum":
    return (mask / samples).astype(np.float32)
  if aggregation == "constant":
    if max_len < 1:
      raise ValueError("the constant aggregation (Dr. GRPO) needs the response budget max_len")
    return (mask / (samples * max_len)).astype(np.float32)
  return np.where(mask, 1.0 / (np.maximum(tokens_per_sample[sample_B], 1) * samples), 0.0).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Objective:
  """The policy loss (config: `rl.loss`), TRL 1.16's GRPO objectives by parts:
  - `kind`: "clip" (PPO's clipped ratio: GRPO, DAPO, GSPO), "cispo" (MiniMax-M1: the ratio, capped at
    `cispo_max` and detached, weighs A log p), "sapo" (a sigmoid gate of temperatures `sapo_temperatures`,
    (positive, negative advantages), instead of clipping), "vespo" (a gamma weight of the sequence's ratio,
    `vespo` = (k+, lambda+, k-, lambda-), detached, weighs A log p);
  - `aggregation`: see `token_weights` ("sequence_sum": each sample's summed token losses over samples, TRL's
    luspo);
  - `importance_level`: "token", or "sequence" (GSPO: every token's ratio is its sequence's geometric mean);
  - `dual_clip` > 0: the ratio capped there where the advantage is negative (TRL `delta`, verl `clip_ratio_c`);
  - `off_policy_mask` > 0: a negative-advantage sequence whose mean log(p_rollout / p) exceeds it leaves the
    loss (DeepSeek-V3.2; TRL `off_policy_mask_threshold`);
  - `top_entropy_quantile` < 1: only that share of each micro-batch's trained tokens, the highest-entropy,
    carry the policy loss ("Beyond the 80/20 rule": 0.2);
  - `kl_coef` > 0: k3 KL to the reference; `kl_is_correction`: weighed by the ratio (TRL
    `use_bias_correction_kl`)."""
  kind: str = "clip"
  aggregation: str = "token"
  importance_level: str = "token"
  clip_low: float = 0.2
  clip_high: float = 0.28
  dual_clip: float = 0.0
  cispo_max: float = 5.0
  sapo_temperatures: tuple = (1.0, 1.05)
  vespo: tuple = (2.0, 3.0, 3.0, 2.0)
  off_policy_mask: float = 0.0
  top_entropy_quantile: float = 1.0
  kl_coef: float = 0.0
  kl_is_correction: bool = False

  def __post_init__(self):
    for name, options in (("kind", LOSSES), ("aggregation", AGGREGATIONS), ("importance_level", IMPORTANCE_LEVELS)):
      fields.require(getattr(self, name) in options, name, getattr(self, name), f"must be one of {options}")
    fields.at_least(self, 0, "clip_low", "clip_high", "dual_clip", "off_policy_mask", "kl_coef")
    fields.require(self.clip_low < 1, "clip_low", self.clip_low, "must be < 1")
    fields.require(not self.dual_clip or self.dual_clip > 1 + self.clip_high, "dual_clip", self.dual_clip,
                   "must be 0 (off) or above 1 + clip_high")
    fields.require(self.cispo_max > 0, "cispo_max", self.cispo_max, "must be > 0")
    fields.require(0 < self.top_entropy_quantile <= 1, "top_entropy_quantile", self.top_entropy_quantile,
                   "must be in (0, 1]")
    fields.require(len(self.sapo_temperatures) == 2 and min(self.sapo_temperatures) > 0, "sapo_temperatures",
                   self.sapo_temperatures, "must be two temperatures > 0 (positive, negative advantages)")
    fields.require(len(self.vespo) == 4 and min(self.vespo) >= 0, "vespo", self.vespo,
                   "must be (k+, lambda+, k-, lambda-), each >= 0")


def per_sequence(x_BxT: jax.Array, segments_BxT: jax.Array, mask_BxT: jax.Array, mean: bool) -> jax.Array:
  """Each token's sequence's sum (or mean) of `x` over the sequence's `mask`ed tokens; a row's sequences are its
  segments (row-local: rows may be sharded)."""
  t = x_BxT.shape[1]
  reduce = jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=t))
  total = reduce(jnp.where(mask_BxT, x_BxT, 0.0), segments_BxT)
  if mean:
    total = total / jnp.maximum(reduce(mask_BxT.astype(x_BxT.dtype), segments_BxT), 1.0)
  return jnp.take_along_axis(total, segments_BxT, axis=1)


def policy_loss(logp_BxT: jax.Array, old_logp_BxT: jax.Array, advantages_BxT: jax.Array, weights_BxT: jax.Array,
                objective: Objective, segments_BxT: jax.Array | None = None, ref_logp_BxT: jax.Array | None = None,
                is_weights_BxT: jax.Array | None = None, rollout_logp_BxT: jax.Array | None = None,
                entropy_BxT: jax.Array | None = None):
  """The policy loss of `objective` over per-token log-probs, summed with the aggregation's `weights_BxT`.

  "clip": ratio r = exp(logp - old) (per sequence: exp of the sequence's mean log-ratio); per token
  -min(r' A, clip(r, 1 - clip_low, 1 + clip_high) A), r' = min(r, dual_clip) where set. Each token's policy term
  is then masked (off-policy sequences, low-entropy tokens) and weighed by `is_weights_BxT` (the rollout
  correction; "vespo" folds it into its weight instead); the KL is k3, exp(ref - logp) - (ref - logp) - 1.
  `segments_BxT` (the packed rows' segment ids) is needed by sequence-level options, `rollout_logp_BxT` by
  the off-policy mask (else the old log-probs), `entropy_BxT` by the entropy mask. Returns (loss, stats):
  stats are weighted means (clip fraction, KL, ratio, masked share)."""
  o = objective
  mask = weights_BxT > 0
  seq = lambda x, mean: per_sequence(x, segments_BxT, mask, mean)
  log_ratio = logp_BxT - old_logp_BxT
  ratio = jnp.exp(seq(log_ratio, True) if o.importance_level == "sequence" else log_ratio)
  a = advantages_BxT
  if o.kind == "clip":
    clipped = jnp.clip(ratio, 1.0 - o.clip_low, 1.0 + o.clip_high) * a
    capped = jnp.minimum(ratio, o.dual_clip) if o.dual_clip else ratio
    pg = -jnp.minimum(capped * a, clipped)
    clip_frac = (clipped < capped * a)
  elif o.kind == "cispo":
    pg = -jax.lax.stop_gradient(jnp.minimum(ratio, o.cispo_max)) * a * logp_BxT
    clip_frac = (ratio > o.cispo_max) & (a > 0)
  elif o.kind == "sapo":
    tau = jnp.where(a > 0, *o.sapo_temperatures)
    pg = -jax.nn.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * a
    clip_frac = jnp.zeros_like(mask)
  else:  # vespo
    pg = -vespo_weights(log_ratio, a, is_weights_BxT, seq, o.vespo) * a * logp_BxT
    clip_frac = jnp.zeros_like(mask)
  keep = jnp.ones_like(mask)
  if o.off_policy_mask:
    sampled = old_logp_BxT if rollout_logp_BxT is None else rollout_logp_BxT
    drift = seq(sampled - jax.lax.stop_gradient(logp_BxT), True)
    keep &= (a >= 0) | (drift <= o.off_policy_mask)
  if o.top_entropy_quantile < 1:
    keep &= high_entropy(entropy_BxT, mask, o.top_entropy_quantile)
  pg = pg * keep
  if is_weights_BxT is not None and o.kind != "vespo":
    pg = pg * is_weights_BxT
  loss = (pg * weights_BxT).sum()
  stats = {"pg_loss": loss, "clip_frac": (clip_frac * weights_BxT).sum(), "ratio": (ratio * weights_BxT).sum()}
  if o.off_policy_mask or o.top_entropy_quantile < 1:
    stats["masked"] = ((~keep) * weights_BxT).sum()
  if ref_logp_BxT is not None:
    d = ref_logp_BxT - logp_BxT
    kl = (jnp.exp(d) - d - 1.0) * weights_BxT
    stats["kl"] = kl.sum()
    loss = loss + o.kl_coef * (kl * ratio if o.kl_is_correction else kl).sum()
  return loss, stats


def vespo_weights(log_ratio_BxT, advantages_BxT, is_weights_BxT, seq, params) -> jax.Array:
  """VESPO's detached gamma weight phi(w) = exp(lambda + k log w - lambda w) of the sequence's ratio w (its
  summed, clamped log-ratios, times the rollout correction's weights), k and lambda by the advantage's sign."""
  k_pos, lambda_pos, k_neg, lambda_neg = params
  floor = math.log(1e-8)
  log_w = seq(jnp.clip(log_ratio_BxT, -20.0, 20.0), False)
  if is_weights_BxT is not None:
    log_w = log_w + seq(jnp.clip(jnp.log(is_weights_BxT), floor, 20.0), False)
  log_w = jnp.clip(log_w, floor, 20.0)
  positive = advantages_BxT >= 0
  k, lam = jnp.where(positive, k_pos, k_neg), jnp.maximum(jnp.where(positive, lambda_pos, lambda_neg), 1e-4)
  phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
  return jax.lax.stop_gradient(jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0))


def high_entropy(entropy_BxT: jax.Array, mask_BxT: jax.Array, quantile: float) -> jax.Array:
  """The `quantile` share of the masked tokens with the highest entropy: entropy >= the (1 - quantile)
  quantile (linear interpolation, as torch.quantile) of the masked tokens' entropies."""
  threshold = jnp.nanquantile(jnp.where(mask_BxT, entropy_BxT, jnp.nan), 1.0 - quantile)
  return (entropy_BxT >= threshold) & mask_BxT
