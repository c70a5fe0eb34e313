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


def long_tail(rng, v=160, big=10, zeros=40):
  """A distribution over v tokens: `big` likely ones holding half the mass, `zeros` impossible ones,
  the rest sharing the other half, shuffled: most of it beyond the shortlist."""
  p = np.zeros(v)
  p[:big] = rng.dirichlet(np.ones(big)) * 0.5
  p[big + zeros:] = 0.5 / (v - big - zeros)
  return rng.permutation(p)


def test_draws_beyond_the_shortlist_follow_the_distribution():
  """The lumped tail (most tokens here) is drawn with the mass it holds, token by token."""
  p = long_tail(np.random.RandomState(0))
  assert (p > 0).sum() > sampling.SHORTLIST
  n = 60_000
  with np.errstate(divide="ignore"):
    logp = jnp.broadcast_to(jnp.asarray(np.log(p), jnp.float32), (n, len(p)))
  tokens, lp = sampling.sample(logp, keys_for(n), SamplingParams(temperature=1.0))
  counts = np.bincount(np.asarray(tokens), minlength=len(p))
  assert counts[p == 0].sum() == 0
  assert stats.chisquare(counts[p > 0], p[p > 0] * n).pvalue > 1e-3
  np.testing.assert_allclose(np.asarray(lp), np.log(p[np.asarray(tokens)]), rtol=1e-5)


def test_zero_probability_tokens_are_never_drawn_even_at_the_edges():
  """Masked tokens before, between and after the kept ones, in the shortlist and in the lumped
  tail, whose uniform at 0 and just below 1 draws its first and last possible token."""
  logp = jnp.log(jnp.asarray([[0, 0.5, 0, 0.5, 0, 0]], jnp.float32))
  params = SamplingParams(temperature=1.0)
  n = 4096
  tokens, lp = sampling.sample(jnp.broadcast_to(logp, (n, 6)), keys_for(n, 1), params)
  assert set(np.asarray(tokens).tolist()) == {1, 3} and np.isfinite(np.asarray(lp)).all()
  possible = np.zeros(200)
  possible[3:-3:2] = 1  # 97 equal tokens; the shortlist takes the first 32 (ties: lower ids first)
  logp = jnp.log(jnp.asarray(possible[None] / possible.sum(), jnp.float32))
  tail = np.flatnonzero(possible)[sampling.SHORTLIST:]
  for u in (0.0, np.nextafter(np.float32(1), np.float32(0))):  # the tail's extreme uniforms
    with mock.patch.object(jax.random, "uniform", lambda key: jnp.float32(u)), \
         mock.patch.object(jax.random, "gumbel", lambda key: jnp.float32(0)):  # the lump (2/3 of the mass) wins
      token, _ = sampling.sample(logp, keys_for(1), params)
    assert int(token[0]) == (tail[0] if u == 0 else tail[-1])


def test_a_drafter_draws_the_targets_token_when_its_distribution_is_the_targets():
  """Noise is keyed by token id: a reduced head (its own indices, `token_ids` mapping them to the
  target's) holding the target's distribution draws the target's token with every key."""
  rng = np.random.RandomState(1)
  p = long_tail(rng)
  head = np.sort(np.concatenate([np.flatnonzero(p > 0), rng.choice(np.flatnonzero(p == 0), 5, replace=False)]))
  n = 2000
  with np.errstate(divide="ignore"):
    logp, logq = (jnp.broadcast_to(jnp.asarray(np.log(x), jnp.float32), (n, len(x))) for x in (p, p[head]))
  target = sampling.draw(logp, keys_for(n, 2))
  draft = sampling.draw(logq, keys_for(n, 2), lambda i: jnp.asarray(head)[i])
  np.testing.assert_array_equal(head[np.asarray(draft)], np.asarray(target))


def test_gumbel_coupling_matches_as_often_as_the_bounds_say():
  """Two distributions drawn with the same keys agree at most 1 - TV(p, q) of the time (any
  coupling) and, for a Gumbel-max coupling, at least (1 - TV) / (1 + TV): far above what one
  shared uniform against two cumulative distributions gives here."""
  rng = np.random.RandomState(3)
  v, n = 120, 20_000
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
