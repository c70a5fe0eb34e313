"""BEG-MAB: buckets, unseen arms first, median exploitation, epsilon exploration, state round trip."""

import json

import pytest

from tlt_jax.rollout.bandit import Bandit
from tlt_jax.rollout.speculative import Strategy

A, B = Strategy.parse("4_1_5"), Strategy.parse("6_4_16")


def test_buckets_follow_the_thresholds():
  bandit = Bandit([A])
  assert [bandit.bucket(n) for n in (1, 2, 4, 5, 20, 21, 500)] == [0, 1, 1, 2, 2, 3, 3]
  assert list(bandit.stats()) == ["1", "2-4", "5-20", "21+"]
  with pytest.raises(ValueError, match="thresholds"):
    Bandit([A], thresholds=(2, 5))


def test_unseen_arms_first_then_the_best_median():
  bandit = Bandit([A, B], epsilon=0.0)
  played = []
  for _ in range(3):
    arm = bandit.choose(1)
    played.append(arm)
    bandit.update(1, arm, tokens={None: 100, A: 300, B: 200}[arm], seconds=1.0)
  assert played == [None, A, B]  # SD off is an arm of every bucket
  assert bandit.choose(1) == A
  # The median ignores one outlier: a single huge reward for B does not make it the best.
  for r in (150, 10_000, 160):
    bandit.update(1, B, r, 1.0)
  assert bandit.choose(1) == A
  assert bandit.choose(30) is None  # another bucket starts from scratch
  bandit.update(30, None, 10, 1.0)
  assert bandit.stats()["21+"]["off"] == {"plays": 1, "median_tokens_per_s": 10.0}


def test_epsilon_explores_and_the_window_forgets():
  bandit = Bandit([A, B], epsilon=0.5, window=2, seed=0)
  for arm, r in ((None, 1), (A, 100), (B, 1)):
    bandit.update(1, arm, r, 1.0)
  picks = [bandit.choose(1) for _ in range(400)]
  assert 0.6 < picks.count(A) / 400 < 0.75  # 1 - eps + eps / 3 = 0.67
  for _ in range(2):  # A's old reward falls out of its 2-reward window
    bandit.update(1, A, 0, 1.0)
  assert bandit.stats()["1"]["4_1_5"]["median_tokens_per_s"] == 0


def test_state_round_trips_through_json():
  bandit = Bandit([A, B], seed=3)
  for i in range(10):
    bandit.update(1 + i, [None, A, B][i % 3], 10 * i, 1.0)
  restored = Bandit([A, B], seed=99)
  restored.load_state_dict(json.loads(json.dumps(bandit.state_dict())))
  assert restored.stats() == bandit.stats()
  assert [restored.choose(7) for _ in range(20)] == [bandit.choose(7) for _ in range(20)]
  with pytest.raises(ValueError, match="does not match"):
    Bandit([A]).load_state_dict(bandit.state_dict())
