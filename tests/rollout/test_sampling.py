"""The sampling distribution (temperature, top-k, top-p) against analytic values, and row keys."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from tlt_jax.rollout import sampling
from tlt_jax.rollout.sampling import SamplingParams

LOGITS = np.log(np.asarray([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]], np.float32))


def probs(params):
  return np.exp(np.asarray(sampling.log_probs(jnp.asarray(LOGITS), params)))[0]


def test_temperature_top_k_top_p_analytic():
  np.testing.assert_allclose(probs(SamplingParams(temperature=1.0)), np.exp(LOGITS[0]), atol=1e-6)
  p2 = np.exp(LOGITS[0] / 2) / np.exp(LOGITS[0] / 2).sum()
  np.testing.assert_allclose(probs(SamplingParams(temperature=2.0)), p2, atol=1e-6)
  top2 = np.asarray([0.4, 0.25, 0, 0, 0, 0]) / 0.65
  np.testing.assert_allclose(probs(SamplingParams(top_k=2)), top2, atol=1e-6)
  # top_p=0.75: 0.4 + 0.25 = 0.65 < 0.75, so the smallest set reaching 0.75 has three tokens.
  top3 = np.asarray([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8
  np.testing.assert_allclose(probs(SamplingParams(top_p=0.75)), top3, atol=1e-6)
  np.testing.assert_allclose(probs(SamplingParams(top_p=0.3)), [1, 0, 0, 0, 0, 0], atol=1e-6)
  np.testing.assert_allclose(probs(SamplingParams(top_k=3, top_p=0.7)), [0.4 / 0.65, 0.25 / 0.65, 0, 0, 0, 0],
                             atol=1e-6)


def test_samples_follow_the_distribution():
  params = SamplingParams(temperature=1.0, top_p=0.9)
  n = 40_000
  logp = jnp.broadcast_to(sampling.log_probs(jnp.asarray(LOGITS), params), (n, 6))
  tokens, lp = sampling.sample(logp, keys_for(n), params)
  counts = np.bincount(np.asarray(tokens), minlength=6)
  expected = probs(params) * n
  assert counts[expected == 0].sum() == 0
  assert stats.chisquare(counts[expected > 0], expected[expected > 0]).pvalue > 1e-3
  np.testing.assert_allclose(np.asarray(lp), np.log(probs(params)[np.asarray(tokens)]), atol=1e-6)


def keys_for(n, seed=0):
  return sampling.row_keys(seed, jnp.zeros(n, jnp.int32), jnp.arange(n), jnp.zeros(n, jnp.int32))


def long_tail(rng, v=1000, big=10):
  """A distribution over v tokens (blocks of sampling.BLOCK, the last one partial): `big` likely
  ones holding half the mass, the rest sharing the other half, except impossible tokens at every
  block's edges and in the whole third block."""
  p = np.zeros(v)
  p[rng.choice(v, big, replace=False)] = rng.dirichlet(np.ones(big)) * 0.5
  p[p == 0] = 0.5 / (p == 0).sum()
  p[impossible(v)] = 0
  return p / p.sum()


def impossible(v):
  """Token ids `long_tail` gives no mass: the first, second and last of every block, and block 2."""
  ids = np.arange(v)
  within = ids % sampling.BLOCK
  return (within <= 1) | (within == sampling.BLOCK - 1) | (ids == v - 1) | (ids // sampling.BLOCK == 2)


def test_draws_follow_a_long_tailed_distribution_across_blocks():
  p = long_tail(np.random.RandomState(0))
  assert len(p) > 3 * sampling.BLOCK
  n = 60_000
  with np.errstate(divide="ignore"):
    logp = jnp.broadcast_to(jnp.asarray(np.log(p), jnp.float32), (n, len(p)))
  tokens, lp = sampling.sample(logp, keys_for(n), SamplingParams(temperature=1.0))
  counts = np.bincount(np.asarray(tokens), minlength=len(p))
  assert counts[p == 0].sum() == 0
  assert stats.chisquare(counts[p > 0], p[p > 0] * n).pvalue > 1e-3
  np.testing.assert_allclose(np.asarray(lp), np.log(p[np.asarray(tokens)]), rtol=1e-5)


def test_zero_probability_tokens_are_never_drawn_even_when_the_noise_favours_them():
  """Noise of +1e30 on every impossible block and token (and 0 elsewhere) still draws a possible one."""
  logp = jnp.log(jnp.asarray([[0, 0.5, 0, 0.5, 0, 0]], jnp.float32))
  params = SamplingParams(temperature=1.0)
  n = 4096
  tokens, lp = sampling.sample(jnp.broadcast_to(logp, (n, 6)), keys_for(n, 1), params)
  assert set(np.asarray(tokens).tolist()) == {1, 3} and np.isfinite(np.asarray(lp)).all()
  p = long_tail(np.random.RandomState(2))
  favour = lambda mask: (lambda key, shape: jnp.where(jnp.asarray(mask), jnp.float32(1e30), jnp.float32(0)))
  blocks = -(-len(p) // sampling.BLOCK)
  zero_block = np.arange(blocks) == 2
  zero_within = impossible(blocks * sampling.BLOCK)[:sampling.BLOCK]
  with np.errstate(divide="ignore"):
    logp = jnp.asarray(np.log(p)[None], jnp.float32)
  with mock.patch.object(jax.random, "gumbel", side_effect=lambda key, shape: favour(
      zero_block if shape == (blocks,) else zero_within)(key, shape)) as noise:
    token, lp = sampling.sample(logp, keys_for(1), params)
  assert noise.call_count == 2 and p[int(token[0])] > 0 and np.isfinite(float(lp[0]))


def test_gumbel_coupling_matches_as_often_as_the_bounds_say():
  """Two distributions drawn with the same keys agree at most 1 - TV(p, q) of the time (any
  coupling) and, here, at least (1 - TV) / (1 + TV) (one Gumbel-max draw's bound, which the two
  levels meet on these distributions): far above what one shared uniform against two cumulative
  distributions gives."""
  rng = np.random.RandomState(3)
  v, n = 700, 20_000
  p, q = (np.exp(x) / np.exp(x).sum() for x in 2.5 * rng.normal(size=(2, v)))
  q = 0.5 * q + 0.5 * p  # related, as a drafter is to its target
  agree = 1 - 0.5 * np.abs(p - q).sum()
  keys = keys_for(n, 4)
  draws = [np.asarray(sampling.draw(jnp.broadcast_to(jnp.asarray(np.log(x), jnp.float32), (n, v)), keys))
           for x in (p, q)]
  match = np.mean(draws[0] == draws[1])
  slack = 3 * np.sqrt(0.25 / n)
  assert agree / (2 - agree) - slack < match < agree + slack
  u = rng.random_sample(n)
  inverse_cdf = np.mean(np.searchsorted(np.cumsum(p), u) == np.searchsorted(np.cumsum(q), u))
  assert match > inverse_cdf + 0.05


def test_gumbel_gaps_rank_the_drawn_token_first_with_the_same_noise():
  """gumbel_gaps uses draw's own noise: 0 exactly at the drawn token, negative elsewhere, -inf where
  p is 0 (a block left empty too); one key shared along a trailing axis gives each slice its gaps."""
  rng = np.random.RandomState(5)
  v, n = 700, 500
  p = rng.dirichlet(np.full(v, 0.3), size=2)
  p[:, 512:] = 0  # the last (partial) block empty
  p[:, rng.choice(512, 100, replace=False)] = 0
  p /= p.sum(-1, keepdims=True)
  with np.errstate(divide="ignore"):
    logp = jnp.broadcast_to(jnp.asarray(np.log(p), jnp.float32), (n, 2, v))
  keys = keys_for(n, 6)
  gaps = np.asarray(sampling.gumbel_gaps(logp, keys))
  drawn = np.asarray(sampling.draw(logp, jnp.broadcast_to(keys[:, None], (n, 2))))
  np.testing.assert_array_equal(np.argmax(gaps, -1), drawn)
  assert ((gaps == 0).sum(-1) == 1).all() and (gaps <= 0).all() and not np.isnan(gaps).any()
  assert np.isneginf(gaps[..., p[0] == 0][:, 0]).all() and np.isfinite(gaps[:, 0, p[0] > 0]).all()
  np.testing.assert_array_equal(gaps[:, 1], np.asarray(sampling.gumbel_gaps(logp[:, 1], keys)))


def test_greedy_is_argmax_with_its_log_prob():
  tokens, lp = sampling.sample(sampling.log_probs(jnp.asarray(LOGITS), SamplingParams(temperature=0)), None,
                               SamplingParams(temperature=0))
  assert tokens.tolist() == [0] and np.isclose(float(lp[0]), np.log(0.4), atol=1e-6)


def test_row_keys_depend_only_on_identity():
  a = sampling.row_keys(7, jnp.asarray([3, 1]), jnp.asarray([2, 0]), jnp.asarray([5, 5]))
  b = sampling.row_keys(7, jnp.asarray([1, 3]), jnp.asarray([0, 2]), jnp.asarray([5, 5]))
  data = lambda k: np.asarray(jax.random.key_data(k))
  np.testing.assert_array_equal(data(a)[0], data(b)[1])
  assert not np.array_equal(data(a)[0], data(a)[1])


FINITE = "must be a finite number >= 0"


@pytest.mark.parametrize("kwargs, why", [
    (dict(temperature=-1), FINITE), (dict(temperature=float("nan")), FINITE), (dict(temperature=float("inf")), FINITE),
    (dict(top_k=-1), "must be >= 0"),
    (dict(top_p=0), r"must be in \(0, 1\]"), (dict(top_p=float("nan")), r"must be in \(0, 1\]"),
    (dict(top_p=1.5), r"must be in \(0, 1\]"), (dict(max_new_tokens=0), "must be >= 1")])
def test_bad_params_rejected(kwargs, why):
  """NaN and inf too: a NaN temperature used to sample token 0 forever. `check_field` (what CLI flags
  and config keys use) says the same."""
  (field, value), = kwargs.items()
  with pytest.raises(ValueError, match=f"^{field} {why}, got {value}$"):
    SamplingParams(**kwargs)
  with pytest.raises(ValueError, match=f"^{why}$"):
    sampling.check_field(field, value)
