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
  keys = sampling.row_keys(0, jnp.zeros(n, jnp.int32), jnp.arange(n), jnp.zeros(n, jnp.int32))
  tokens, lp = sampling.sample(logp, keys, params)
  counts = np.bincount(np.asarray(tokens), minlength=6)
  expected = probs(params) * n
  assert counts[expected == 0].sum() == 0
  assert stats.chisquare(counts[expected > 0], expected[expected > 0]).pvalue > 1e-3
  np.testing.assert_allclose(np.asarray(lp), np.log(probs(params)[np.asarray(tokens)]), atol=1e-6)


def test_zero_probability_tokens_are_never_drawn_even_at_the_edges():
  """Masked tokens before, between and after the kept ones; uniforms at 0 and just below 1."""
  logp = jnp.log(jnp.asarray([[0, 0.5, 0, 0.5, 0, 0]], jnp.float32))
  params = SamplingParams(temperature=1.0)
  n = 4096
  keys = sampling.row_keys(1, jnp.zeros(n, jnp.int32), jnp.arange(n), jnp.zeros(n, jnp.int32))
  tokens, lp = sampling.sample(jnp.broadcast_to(logp, (n, 6)), keys, params)
  assert set(np.asarray(tokens).tolist()) == {1, 3} and np.isfinite(np.asarray(lp)).all()
  for u in (0.0, np.nextafter(np.float32(1), np.float32(0))):  # the extreme uniforms
    with mock.patch.object(jax.random, "uniform", lambda key: jnp.float32(u)):
      token, _ = sampling.sample(logp, keys[:1], params)
    assert int(token[0]) == (1 if u == 0 else 3)


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


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(max_new_tokens=0)])
def test_bad_params_rejected(kwargs):
  with pytest.raises(ValueError, match=next(iter(kwargs))):
    SamplingParams(**kwargs)
