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
  """Draws one token per row (`draw`); returns (tokens [B] int32, their log-probs [B])."""
  if params.greedy:
    tokens = jnp.argmax(logp_BxV, axis=-1).astype(jnp.int32)
  else:
    tokens = draw(logp_BxV, keys_B)
  return tokens, jnp.take_along_axis(logp_BxV, tokens[:, None], axis=-1)[:, 0]


# Tokens per draw that get their own Gumbel noise: the SHORTLIST most likely. The rest of the
# vocabulary competes as one lumped entry, so a draw costs about one pass over the distribution
# instead of a random number per vocabulary entry (several times dearer over 49k entries on a CPU).
SHORTLIST = 32
_LUMP, _TAIL = 0xFFFFFFFF, 0xFFFFFFFE  # fold_in data of the lumped entry's noise and its uniform


def draw(logp_xN: jax.Array, keys_x: jax.Array, token_ids=lambda i: i) -> jax.Array:
  """The index in `logp_xN` (any leading shape, one key each) that `sample` draws: a Gumbel-max draw.

  Each of the SHORTLIST most likely entries gets Gumbel noise keyed by (row key, its token id);
  the others are lumped into one entry of their total mass with noise of its own, and when the
  lump wins, the token is drawn from them by inverse transform (their mass in id order against
  one more uniform). By the max-stability of Gumbel noise this is an exact sample of the
  distribution, and noise is a function of the token id alone, so a drafter scoring its own
  distribution q with the same keys (`token_ids` maps its indices to the target's ids) draws the
  same token as the target whenever both maxima agree: a Gumbel-max coupling, accepted with
  probability near 1 - TV(p, q), where matching one uniform's inverse CDF gets about p(argmax q).
  """
  n = logp_xN.shape[-1]
  k = min(SHORTLIST, n)
  top_lp, top_i = jax.lax.top_k(logp_xN, k)
  flat_i = top_i.reshape(-1, k)
  per_key = lambda f: jax.vmap(f)(keys_x.reshape(-1)).reshape(keys_x.shape)
  noise = jax.vmap(lambda key, ids: jax.vmap(lambda t: jax.random.gumbel(jax.random.fold_in(key, t)))(ids))
  g = noise(keys_x.reshape(-1), token_ids(flat_i)).reshape(top_i.shape)
  best = jnp.argmax(top_lp + g, axis=-1)
  best_score = jnp.max(top_lp + g, axis=-1)
  # The lump: every entry but the shortlist's, in index order (zero mass where in the shortlist).
  rest = logp_xN.reshape(-1, n).at[jnp.arange(flat_i.shape[0])[:, None], flat_i].set(-jnp.inf).reshape(logp_xN.shape)
  cdf = jnp.cumsum(jnp.exp(rest), axis=-1)
  mass = cdf[..., -1]
  lump_score = jnp.log(mass) + per_key(lambda key: jax.random.gumbel(jax.random.fold_in(key, _LUMP)))
  u = per_key(lambda key: jax.random.uniform(jax.random.fold_in(key, _TAIL)))
  # u * mass, kept below mass (rounding): the count stops before the trailing zero-mass entries.
  tail = jnp.sum(cdf <= jnp.minimum(u * mass, jnp.nextafter(mass, 0))[..., None], axis=-1)
  chosen = jnp.take_along_axis(top_i, best[..., None], axis=-1)[..., 0]
  return jnp.where(best_score >= lump_score, chosen, tail).astype(jnp.int32)
