"""GRPO / DAPO pieces against values worked out by hand."""

import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rl import grpo


def test_advantages_are_group_normalised():
  r = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
  a = grpo.advantages(r)
  np.testing.assert_allclose(a[0], [1, -1, -1, 1], atol=1e-5)  # mean 0.5, std 0.5
  np.testing.assert_array_equal(a[1], 0)
  np.testing.assert_allclose(grpo.advantages(r, normalize_std=False)[0], [0.5, -0.5, -0.5, 0.5])


def test_dynamic_sampling_keeps_groups_with_signal():
  r = np.array([[1, 0, 1], [1, 1, 1], [0, 0, 0], [0.5, 0.5, 0.2]])
  np.testing.assert_array_equal(grpo.keep_groups(r), [True, False, False, True])


def test_overlong_penalty_is_linear_in_the_buffer():
  # max 100, buffer 20: free up to 80, -0.5 at 90, -1 at 100 and beyond.
  np.testing.assert_allclose(grpo.overlong_penalty([10, 80, 90, 100, 130], 100, 20), [0, 0, -0.5, -1, -1])
  np.testing.assert_array_equal(grpo.overlong_penalty([10, 100], 100, 0), [0, 0])


def test_token_weights_token_and_sequence_aggregation():
  # One row: sample 1 has 1 response token, sample 2 has 3, sample 3 is padding-free but dropped.
  sample = np.array([[1, 1, 2, 2, 2, 2, 3, 3, 0]])
  mask = np.array([[0, 1, 0, 1, 1, 1, 0, 1, 0]])
  keep = np.array([True, True, False])
  tok = grpo.token_weights(sample, mask, keep, "token")
  np.testing.assert_allclose(tok, [[0, 1 / 4, 0, 1 / 4, 1 / 4, 1 / 4, 0, 0, 0]])
  seq = grpo.token_weights(sample, mask, keep, "sequence")
  np.testing.assert_allclose(seq, [[0, 1 / 2, 0, 1 / 6, 1 / 6, 1 / 6, 0, 0, 0]])
  assert not grpo.token_weights(sample, mask, np.zeros(3, bool), "token").any()
  with pytest.raises(ValueError, match="'mean'"):
    grpo.token_weights(sample, mask, keep, "mean")


def test_policy_loss_clips_per_sign_of_the_advantage():
  # Ratios e^0.5 = 1.65 and e^-0.5 = 0.61, clip range [0.8, 1.28] (DAPO clip-higher).
  logp = jnp.array([[0.5, 0.5, -0.5, -0.5, 0.0]])
  old = jnp.zeros((1, 5))
  adv = jnp.array([[1.0, -1.0, 1.0, -1.0, 2.0]])
  w = jnp.full((1, 5), 0.2)
  loss, stats = grpo.policy_loss(logp, old, adv, w, clip_low=0.2, clip_high=0.28)
  r_hi, r_lo = np.exp(0.5), np.exp(-0.5)
  per_token = [-1.28, r_hi, -r_lo, 0.8, -2.0]  # -min(r A, clip(r) A)
  np.testing.assert_allclose(loss, 0.2 * sum(per_token), rtol=1e-6)
  np.testing.assert_allclose(stats["clip_frac"], 0.4, rtol=1e-6)  # tokens 0 and 3 clipped
  # Truncated importance sampling weighs each token's policy-gradient term (not the KL).
  is_w = jnp.array([[2.0, 1.0, 0.5, 1.0, 0.0]])
  weighted, _ = grpo.policy_loss(logp, old, adv, w, clip_low=0.2, clip_high=0.28, is_weights_BxT=is_w)
  np.testing.assert_allclose(weighted, 0.2 * np.dot(per_token, is_w[0]), rtol=1e-6)


def test_low_variance_kl():
  logp = jnp.array([[-1.0, -2.0]])
  ref = jnp.array([[-1.5, -2.0]])
  w = jnp.array([[0.5, 0.5]])
  loss, stats = grpo.policy_loss(logp, logp, jnp.zeros((1, 2)), w, 0.2, 0.2, ref_logp_BxT=ref, kl_coef=0.1)
  kl = 0.5 * (np.exp(-0.5) + 0.5 - 1.0)
  np.testing.assert_allclose(stats["kl"], kl, rtol=1e-6)
  np.testing.assert_allclose(loss, 0.1 * kl, rtol=1e-6)


def test_trained_samples_dynamic_sampling_and_overlong_filter():
  rewards = np.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
  truncated = np.array([[False, True, False], [False, False, False], [True, False, False]])
  np.testing.assert_array_equal(grpo.trained_samples(rewards, truncated, False, False), np.ones(9, bool))
  np.testing.assert_array_equal(grpo.trained_samples(rewards, truncated, True, False),
                                [1, 1, 1, 0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(grpo.trained_samples(rewards, truncated, True, True),
                                [1, 0, 1, 0, 0, 0, 0, 1, 1])
  np.testing.assert_array_equal(grpo.trained_samples(rewards, truncated, False, True),
                                [1, 0, 1, 1, 1, 1, 0, 1, 1])
