"""Rollout corrections for the training-inference mismatch (config: `rl.rollout_correction`), host side, on
packed rows: the rollout's log-probs (bfloat16, its own kernels and cache) against the trainer's old ones.

verl's `algorithm.rollout_correction` and TRL's `vllm_importance_sampling_*`, in one form:
- importance sampling: w = p_trainer / p_rollout per token, or per sequence (the product of its tokens'),
  truncated to [is_min, is_max] ("truncate": verl's TIS, TRL's *_truncate) or zeroed outside it ("mask":
  IcePop, TRL's *_mask), optionally divided by its batch mean; w weighs each token's policy loss;
- rejection: verl's divergence filters of log r = log p_trainer - log p_rollout take tokens (token_k1..k3) or
  whole sequences (seq_sum_*, seq_mean_*, seq_max_*) out of the loss: k1 = -log r within [log lo, log hi],
  k2 = (log r)^2 / 2, k3 = r - 1 - log r at most the threshold; several options, comma separated, all must pass;
- `PRESETS`: verl's decoupled presets by name (bypass_ppo_clip is `rl.old_logp="rollout"`).
`metrics` are verl's off-policy diagnostics and IS / rejection statistics, under `mismatch/`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tlt_jax import fields

SAFETY = 20.0  # log-ratios are clamped to +-this before exp (verl's bound)
IS_LEVELS = ("", "token", "sequence")
IS_MODES = ("truncate", "mask")
REJECTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
PRESETS = {
    "decoupled_token_is": dict(is_level="token", is_max=2.0),
    "decoupled_seq_is": dict(is_level="sequence", is_max=2.0),
    "decoupled_token_icepop": dict(is_level="token", is_mode="mask", is_min=0.5, is_max=5.0),
    "decoupled_seq_is_rs": dict(is_level="sequence", is_max=2.0, rs="seq_sum_k1", rs_threshold="0.5_2.0"),
    "decoupled_geo_rs": dict(rs="seq_mean_k1", rs_threshold="0.999_1.001"),
    "decoupled_geo_rs_seq_tis": dict(is_level="sequence", is_max=2.0, rs="seq_mean_k1",
                                     rs_threshold="0.999_1.001"),
    "decoupled_geo_rs_token_tis": dict(is_level="token", is_max=2.0, rs="seq_mean_k1", rs_threshold="0.999_1.001"),
    "decoupled_k3_rs": dict(rs="seq_mean_k3", rs_threshold="0.01"),
    "decoupled_k3_rs_seq_tis": dict(is_level="sequence", is_max=2.0, rs="seq_mean_k3", rs_threshold="0.01"),
    "decoupled_k3_rs_token_tis": dict(is_level="token", is_max=2.0, rs="seq_mean_k3", rs_threshold="0.01"),
}


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
  """`is_level` "" (no weights), "token" or "sequence"; `rs`: rejection options, comma separated ("" none);
  `rs_threshold`: one bound per option or one for all, "lo_hi" for k1 options (a single value v: 1/v_v)."""
  is_level: str = ""
  is_mode: str = "truncate"
  is_min: float = 0.0
  is_max: float = 2.0
  is_batch_normalize: bool = False
  rs: str = ""
  rs_threshold: str = ""

  def __post_init__(self):
    fields.require(self.is_level in IS_LEVELS, "is_level", self.is_level, f"must be one of {IS_LEVELS}")
    fields.require(self.is_mode in IS_MODES, "is_mode", self.is_mode, f"must be one of {IS_MODES}")
    fields.require(0 <= self.is_min < self.is_max, "is_min", self.is_min, f"must be in [0, is_max={self.is_max})")
    for option in self.options:
      fields.require(option in REJECTIONS, "rs", self.rs, f"must name options of {REJECTIONS}, comma separated")
    try:
      self.bounds()
    except ValueError as e:
      raise fields.FieldError("rs_threshold", self.rs_threshold, str(e)) from None

  @property
  def options(self) -> list[str]:
    return [o.strip() for o in self.rs.split(",") if o.strip()]

  @property
  def enabled(self) -> bool:
    return bool(self.is_level or self.options)

  def bounds(self) -> dict[str, tuple[float, float]]:
    """Each rejection option's (lower, upper) bound on its statistic (k1: on -log r, as logs of the ratio bounds;
    k2 / k3: (-inf, upper])."""
    specs = [s.strip() for s in str(self.rs_threshold).split(",") if s.strip()]
    if not self.options:
      return {}
    if len(specs) not in (1, len(self.options)):
      raise ValueError(f"must give one bound, or one per option of rs={self.rs!r}")
    out = {}
    for option, spec in zip(self.options, specs * len(self.options) if len(specs) == 1 else specs):
      lo, _, hi = spec.rpartition("_")
      try:
        upper, lower = float(hi), (float(lo) if lo else None)
      except ValueError:
        raise ValueError(f"must be numbers ('lo_hi' for k1 options), got {spec!r}") from None
      if option.endswith("k1"):
        lower = 1.0 / upper if lower is None else lower
        if min(lower, upper) <= 0:
          raise ValueError(f"{option}'s bounds must be > 0, got {spec!r}")
        out[option] = (math.log(lower), math.log(upper))
      else:
        if lo or upper <= 0:
          raise ValueError(f"{option} takes one upper bound > 0, got {spec!r}")
        out[option] = (-math.inf, upper)
    return out

  def apply(self, trainer_logp: np.ndarray, rollout_logp: np.ndarray, rows_5xRxT: np.ndarray):
    """(is_weights [R, T] or None, the loss mask with rejected tokens out, metrics) for packed rows whose
    index plane numbers the samples; the log-prob planes hold each trained token's log-prob."""
    mask = (rows_5xRxT[3] > 0) & (rows_5xRxT[4] > 0)
    if not mask.any():
      return None, rows_5xRxT[3], {}
    seq = _Sequences(rows_5xRxT[4], mask)
    train, roll = (np.asarray(x, np.float64)[mask] for x in (trainer_logp, rollout_logp))
    log_r = train - roll
    metrics = offpolicy_metrics(train, roll, seq)
    weights = None
    if self.is_level:
      level_log_r = log_r if self.is_level == "token" else seq.broadcast(seq.sum(log_r))
      raw = np.exp(np.clip(level_log_r, -SAFETY, SAFETY))
      if self.is_mode == "truncate":
        w = np.clip(raw, self.is_min, self.is_max)
      else:
        w = np.where((raw >= self.is_min) & (raw <= self.is_max), raw, 0.0)
      metrics.update(self._is_metrics(w, raw, seq.sum(log_r), seq))
      if self.is_batch_normalize:
        mean = w.mean() if self.is_level == "token" else seq.mean(w).mean()
        w = w / mean if mean > 1e-8 else w
      weights = np.ones(mask.shape, np.float32)
      weights[mask] = w
    loss_mask = rows_5xRxT[3].copy()
    if self.options:
      keep = np.ones(len(log_r), bool)
      k = {1: -np.clip(log_r, -SAFETY, SAFETY)}
      k[2] = 0.5 * k[1] ** 2
      k[3] = np.exp(-k[1]) - 1.0 + k[1]
      for option, (lower, upper) in self.bounds().items():
        per_token = k[int(option[-1])]
        stat = {"token": lambda v: v, "seq_sum": lambda v: seq.broadcast(seq.sum(v)),
                "seq_mean": lambda v: seq.broadcast(seq.mean(v)),
                "seq_max": lambda v: seq.broadcast(seq.max(v))}[option.rsplit("_", 1)[0]](per_token)
        keep &= (stat >= lower) & (stat <= upper)
      metrics["mismatch/rs_masked_fraction"] = float(1.0 - keep.mean())
      metrics["mismatch/rs_seq_masked_fraction"] = float(seq.max((~keep).astype(np.float64)).mean())
      loss_mask[mask] = loss_mask[mask] * keep
    return weights, loss_mask, metrics

  def _is_metrics(self, w, raw, seq_log_r, seq) -> dict[str, float]:
    """verl's IS statistics: the applied weights' mean, extremes, spread and effective sample size, and the
    shares of raw ratios above / below the bounds (the lower: is_min, else 1 / is_max)."""
    lower = self.is_min or 1.0 / self.is_max
    if self.is_level == "sequence":
      high, low = (seq_log_r > math.log(self.is_max)).mean(), (seq_log_r < math.log(lower)).mean()
      biggest, smallest = math.exp(min(seq_log_r.max(), SAFETY)), math.exp(seq_log_r.min())
    else:
      high, low = (raw > self.is_max).mean(), (raw < lower).mean()
      biggest, smallest = w.max(), w.min()
    bounded = np.clip(w, 0.0, self.is_max)
    spread = math.sqrt(max((bounded ** 2).mean() - bounded.mean() ** 2, 0.0)) if len(w) > 1 else 0.0
    normalised = bounded / (bounded.mean() + 1e-8)
    return {"mismatch/is_mean": float(w.mean()), "mismatch/is_max": float(biggest),
            "mismatch/is_min": float(smallest),
            "mismatch/is_ratio_fraction_high": float(high), "mismatch/is_ratio_fraction_low": float(low),
            "mismatch/is_std": spread, "mismatch/is_eff_sample_size": float(1.0 / (normalised ** 2).mean())}


def offpolicy_metrics(train: np.ndarray, roll: np.ndarray, seq: "_Sequences") -> dict[str, float]:
  """verl's off-policy diagnostics of the trained tokens' log-probs (trainer's, rollout's): KL(rollout ||
  trainer) directly and by k3 (and the tokens' mean |log p gap|), each side's perplexity (the sequences' mean),
  their log difference, and the chi-squared divergences of the token and sequence ratios."""
  log_r = train - roll
  mean_train, mean_roll = seq.mean(train), seq.mean(roll)
  diff = mean_roll - mean_train
  return {"mismatch/logp_abs_diff": float(np.abs(log_r).mean()),  # ours: the mean |trainer - rollout log p|
          "mismatch/kl": float((roll - train).mean()), "mismatch/k3_kl": float((np.expm1(log_r) - log_r).mean()),
          "mismatch/training_ppl": float(np.exp(-mean_train).mean()),
          "mismatch/training_log_ppl": float(-mean_train.mean()),
          "mismatch/rollout_ppl": float(np.exp(-mean_roll).mean()),
          "mismatch/rollout_log_ppl": float(-mean_roll.mean()),
          "mismatch/log_ppl_diff": float(diff.mean()), "mismatch/log_ppl_abs_diff": float(np.abs(diff).mean()),
          "mismatch/log_ppl_diff_max": float(diff.max()), "mismatch/log_ppl_diff_min": float(diff.min()),
          "mismatch/ppl_ratio": float(np.exp(diff).mean()),
          "mismatch/chi2_token": float((np.exp(2 * np.clip(log_r, -SAFETY, SAFETY))).mean() - 1.0),
          "mismatch/chi2_seq": float(np.exp(2 * np.clip(seq.sum(log_r), -SAFETY, SAFETY)).mean() - 1.0)}


class _Sequences:
  """Per-sequence reductions of values given at the trained tokens (`mask`) of packed rows."""

  def __init__(self, index_RxT: np.ndarray, mask_RxT: np.ndarray):
    _, self.inverse = np.unique(index_RxT[mask_RxT], return_inverse=True)
    self.count = np.bincount(self.inverse)

  def sum(self, v):
    return np.bincount(self.inverse, weights=v, minlength=len(self.count))

  def mean(self, v):
    return self.sum(v) / self.count

  def max(self, v):
    out = np.full(len(self.count), -np.inf)
    np.maximum.at(out, self.inverse, v)
    return out

  def broadcast(self, per_sequence):
    return per_sequence[self.inverse]
