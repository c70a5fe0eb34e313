"""Sampling distributions and per-row random keys.

`log_probs` turns logits into the log-probabilities of the distribution tokens are drawn from
(temperature, then top-k, then top-p). Speculative verification uses the same function, so
plain and speculative decoding sample from exactly the same distribution.

Keys derive from (seed, prompt index, sample index, position of the generated token), never
from a row's slot in the batch: batch size, row order and compaction cannot change a sample.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from tlt_jax import fields


# The valid values of each sampling knob: SamplingParams checks them, and the CLI flags and config
# keys that set a knob check it with `check_field` (one place for the bounds).
_VALID = {
    "temperature": (lambda v: math.isfinite(v) and v >= 0, "must be a finite number >= 0"),
    "top_k": (lambda v: v >= 0, "must be >= 0"),
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),  # NaN fails too
    "max_new_tokens": (lambda v: v >= 1, "must be >= 1"),
}


def check_field(field: str, value) -> None:
  """Raises ValueError saying why (e.g. "must be in (0, 1]") when `value` is not a valid `field`."""
  ok, why = _VALID[field]
  if not ok(value):
    raise ValueError(why)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static (compiled into the rollout executables). temperature 0 = greedy. Config: `rollout.sampling`
  (all but `stop_token_ids` and `seed`)."""

  temperature: float = 1.0
  top_k: int = 0  # 0 = no top-k
  top_p: float = 1.0
  max_new_tokens: int = 256
  stop_token_ids: tuple[int, ...] = ()
  seed: int = 0

  def __post_init__(self):
    for field in _VALID:
      try:
        check_field(field, getattr(self, field))
      except ValueError as e:
        raise fields.FieldError(field, getattr(self, field), str(e)) from None

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def log_probs(logits_BxV: jax.Array, params: SamplingParams) -> jax.Array:
  """Log-probabilities of the sampling distribution (float32; -inf outside top-k / top-p).

  Greedy returns the plain log-softmax (the argmax is the token; its log-prob is reported).
  """
  x = logits_BxV.astype(jnp.float32)
  if params.greedy:
    return jax.nn.log_softmax(x, axis=-1)
  x = x / params.temperature
  if params.top_k:
    kth = jax.lax.top_k(x, min(params.top_k, x.shape[-1]))[0][..., -1:]
    x = jnp.where(x < kth, -jnp.inf, x)
  if params.top_p < 1:
    # Keep the smallest set of most likely tokens whose mass reaches top_p (ties kept together).
    sorted_desc = -jnp.sort(-x, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.sum(mass_before < params.top_p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
    x = jnp.where(x < threshold, -jnp.inf, x)
  return jax.nn.log_softmax(x, axis=-1)


def row_keys(seed: int, prompt_index_B, sample_index_B, position_B) -> jax.Array:
  """One key per row from (seed, prompt index, sample index, generated-token position)."""
  base = jax.random.key(seed)
  fold = lambda p, s, t: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, p), s), t)
  return jax.vmap(fold)(prompt_index_B, sample_index_B, position_B)


def sample(logp_BxV: jax.Array, keys_B: jax.Array, params: SamplingParams):
  """Draws one token per row; returns (tokens [B] int32, their log-probs [B]).

  Inverse transform sampling: one uniform per row against the cumulative distribution, the first
  token whose cumulative mass exceeds it (zero-probability tokens never are). A Gumbel-max draw
  (`jax.random.categorical`) needs a random number per vocabulary entry: on a CPU, over a 49k
  vocabulary, several times the cost, paid once per emitted token and per tree level.
  """
  if params.greedy:
    tokens = jnp.argmax(logp_BxV, axis=-1).astype(jnp.int32)
  else:
    tokens = inverse_cdf(logp_BxV, uniforms(keys_B))
  return tokens, jnp.take_along_axis(logp_BxV, tokens[:, None], axis=-1)[:, 0]


def uniforms(keys_B: jax.Array) -> jax.Array:
  """The uniform in [0, 1) that `sample` draws a row's token with, one per key."""
  return jax.vmap(jax.random.uniform)(keys_B)


def inverse_cdf(logp_xV: jax.Array, u_x: jax.Array) -> jax.Array:
  """The token `sample` draws from `logp_xV` (any leading shape) with uniforms `u_x`: the first whose
  cumulative mass, in vocabulary order, exceeds u times the total."""
  cdf_xV = jnp.cumsum(jnp.exp(logp_xV), axis=-1)
  total_x = cdf_xV[..., -1]
  # u * total, kept below total (rounding): the count stops before the trailing zero-mass tokens.
  x_x = jnp.minimum(u_x * total_x, jnp.nextafter(total_x, 0))
  return jnp.sum(cdf_xV <= x_x[..., None], axis=-1).astype(jnp.int32)
