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


# A draw is two Gumbel-max draws: one over the masses of the vocabulary's BLOCK-token id blocks
# (the last one padded), one over the chosen block's tokens. It costs a pass over the distribution
# and nb + BLOCK random numbers, where one per vocabulary entry is several times dearer on a CPU.
BLOCK = 256
_BLOCKS = 0xFFFFFFFF  # fold_in data of the block-level noise; a block's own noise folds in its index


def _block_noise(key, num_blocks: int):
  return jax.random.gumbel(jax.random.fold_in(key, _BLOCKS), (num_blocks,))


def _token_noise(key, block):
  return jax.random.gumbel(jax.random.fold_in(key, block), (BLOCK,))


def _blocks(logp_xV: jax.Array) -> jax.Array:
  """[..., nb, BLOCK] float32: the distribution's id blocks, the last padded with -inf."""
  v = logp_xV.shape[-1]
  nb = -(-v // BLOCK)
  pad = [(0, 0)] * (logp_xV.ndim - 1) + [(0, nb * BLOCK - v)]
  return jnp.pad(logp_xV.astype(jnp.float32), pad, constant_values=-jnp.inf).reshape(*logp_xV.shape[:-1], nb, BLOCK)


def draw(logp_xV: jax.Array, keys_x: jax.Array) -> jax.Array:
  """The token (an index into `logp_xV`, any leading shape, one key each) that `sample` draws.

  Token ids are split into blocks of BLOCK: a Gumbel-max draw over the blocks' masses picks a
  block, a Gumbel-max draw over its tokens the token, so the draw is an exact sample of the
  distribution. The noise is a function of (key, block index) and (key, token id) alone, so a
  drafter's distribution q drawn with the same key over the same vocabulary (a reduced head's
  mass scattered to its token ids) gives the target's token whenever both argmaxes agree at both
  levels: near one Gumbel per token's match rate, far above one uniform against both cumulative
  distributions (docs/BENCHMARKS.md, the temperature-1 grid).
  """
  lead = logp_xV.shape[:-1]
  blocks = _blocks(logp_xV)
  nb = blocks.shape[-2]
  flat_keys = keys_x.reshape(-1)
  block_noise = jax.vmap(lambda key: _block_noise(key, nb))(flat_keys)
  block = jnp.argmax(jax.nn.logsumexp(blocks, axis=-1) + block_noise.reshape(*lead, nb), axis=-1)
  token_noise = jax.vmap(_token_noise)(flat_keys, block.reshape(-1))
  within = jnp.take_along_axis(blocks, block[..., None, None], axis=-2)[..., 0, :]
  return (block * BLOCK + jnp.argmax(within + token_noise.reshape(*lead, BLOCK), axis=-1)).astype(jnp.int32)


def gumbel_gaps(logp_xV: jax.Array, keys: jax.Array) -> jax.Array:
  """How far each token of `logp_xV` ([..., V]) falls short of being `draw`'s token with `keys` (one
  per index of the leading `keys.ndim` axes, shared along the others): its block's Gumbel score below
  the best block's plus its own score below its block's best. 0 marks the drawn token (ties aside),
  -inf a token of probability 0; the rest are negative. One Gumbel per vocabulary entry and key,
  where `draw` needs a block's worth: it is for rankings (the draft tree's children), not sampling."""
  v, lead = logp_xV.shape[-1], logp_xV.shape[:-1]
  blocks = _blocks(logp_xV)
  nb = blocks.shape[-2]
  flat_keys = keys.reshape(-1)
  spread = keys.shape + (1,) * (len(lead) - keys.ndim)
  block_noise = jax.vmap(lambda key: _block_noise(key, nb))(flat_keys).reshape(*spread, nb)
  token_noise = jax.vmap(lambda key: jax.vmap(lambda b: _token_noise(key, b))(jnp.arange(nb)))(flat_keys)
  block_score = jax.nn.logsumexp(blocks, axis=-1) + block_noise
  token_score = blocks + token_noise.reshape(*spread, nb, BLOCK)
  best = token_score.max(axis=-1, keepdims=True)
  gaps = ((block_score - block_score.max(axis=-1, keepdims=True))[..., None]
          + token_score - jnp.where(jnp.isfinite(best), best, 0.0))  # an empty block: -inf, not nan
  return gaps.reshape(*lead, nb * BLOCK)[..., :v]
