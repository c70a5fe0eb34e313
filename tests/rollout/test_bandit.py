"""BEG-MAB: buckets, unseen arms first, exploitation of the best windowed rate (mean tokens a step over
the median time a step), epsilon exploration (each play says
whether it explores), state round trip, and its goals on synthetic reward tables (best arm >= 90%
after warm-up, tracking a change of the best arm, SD off where speculation is slower)."""

import json

import numpy as np
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


def test_unseen_arms_first_then_the_best_rate():
  bandit = Bandit([A, B], epsilon=0.0)
  played = []
  for _ in range(3):
    arm, explores = bandit.choose(1)
    assert explores  # an arm without a reward is measured
    played.append(arm)
    bandit.update(1, arm, tokens={None: 100, A: 300, B: 200}[arm], seconds=1.0)
  assert played == [None, A, B]  # SD off is an arm of every bucket
  assert bandit.choose(1) == (A, False)
  # The median time a step ignores a stalled play (the machine's noise): one slow play of A among its
  # four does not make it worse than B.
  for seconds in (1.0, 1.0, 50.0):
    bandit.update(1, A, 300, seconds)
  assert bandit.choose(1) == (A, False)
  assert bandit.stats()["1"]["4_1_5"]["tokens_per_s_per_row"] == 300
  assert bandit.choose(30) == (None, True)  # another bucket starts from scratch
  bandit.update(30, None, 300, 1.0)
  assert bandit.stats()["21+"]["off"] == {"plays": 1, "tokens_per_s_per_row": 10.0}  # per active row


def test_skewed_acceptance_counts_at_its_mean():
  """A speculative arm's tokens a step are right-skewed (a few plays accept far more): its throughput
  is the mean, above the median. A median of per-play rates would choose SD off here."""
  bandit = Bandit([A], epsilon=0.0)
  for tokens in (40, 40, 40, 200):  # A, 1 s a step: 20 tokens a step on average, 10 in a typical play
    bandit.update(1, A, tokens, seconds=4.0, steps=4)
  for _ in range(4):
    bandit.update(1, None, 15 * 16, seconds=16.0, steps=16)  # SD off: 15 tokens/s
  assert bandit.stats()["1"]["4_1_5"]["tokens_per_s_per_row"] == pytest.approx(20.0)
  assert bandit.stats()["1"]["off"]["tokens_per_s_per_row"] == pytest.approx(15.0)
  assert bandit.choose(1) == (A, False)


def test_rewards_are_per_active_row():
  """Within a bucket a step costs the same at 5 or 8 active rows (the padded batch): an arm played at 8
  rows that emits fewer tokens per row than another played at 5 is the worse one, whatever its raw rate."""
  bandit = Bandit([A], epsilon=0.0)
  bandit.update(8, A, tokens=8 * 10, seconds=1.0)  # 80 tokens/s, 10 a row
  bandit.update(5, None, tokens=5 * 12, seconds=1.0)  # 60 tokens/s, 12 a row
  assert bandit.choose(6) == (None, False)
  assert bandit.stats()["5-20"]["4_1_5"]["tokens_per_s_per_row"] == 10


def test_epsilon_explores_and_the_window_forgets():
  bandit = Bandit([A, B], epsilon=0.5, window=2, seed=0)
  for arm, r in ((None, 1), (A, 100), (B, 1)):
    bandit.update(1, arm, r, 1.0)
  picks = [bandit.choose(1) for _ in range(400)]
  assert 0.6 < [arm for arm, _ in picks].count(A) / 400 < 0.75  # 1 - eps + eps / 3 = 0.67
  assert 0.4 < sum(explores for _, explores in picks) / 400 < 0.6  # the epsilon picks explore
  assert all(arm == A for arm, explores in picks if not explores)
  bandit.update(1, A, 0, 1.0)
  assert bandit.stats()["1"]["4_1_5"]["tokens_per_s_per_row"] == 50  # the mean of 100 and 0 a step
  bandit.update(1, A, 0, 1.0)  # A's window holds its last 2 rewards
  assert bandit.stats()["1"]["4_1_5"]["tokens_per_s_per_row"] == 0
  for _ in range(2):  # the bucket's horizon holds 2 x 3 plays: SD off's and B's fall out
    bandit.update(1, A, 0, 1.0)
  assert bandit.choose(1) == (None, True)  # an arm with no reward left in the window is retried first


def test_state_round_trips_through_json():
  bandit = Bandit([A, B], seed=3)
  for i in range(10):
    bandit.update(1 + i, [None, A, B][i % 3], 10 * i, 1.0)
  restored = Bandit([A, B], seed=99)
  restored.load_state_dict(json.loads(json.dumps(bandit.state_dict())))
  assert restored.state_dict() == bandit.state_dict()
  assert restored.stats() == bandit.stats()
  assert [restored.choose(7) for _ in range(20)] == [bandit.choose(7) for _ in range(20)]
  old = {**bandit.state_dict(), "plays_window": [[[1, 12.5]], [], [], []]}  # saved before plays held their steps
  restored.load_state_dict(old)
  assert restored.stats()["1"]["4_1_5"]["tokens_per_s_per_row"] == 12.5
  with pytest.raises(ValueError, match="does not match"):
    Bandit([A]).load_state_dict(bandit.state_dict())
  with pytest.raises(ValueError, match="does not match"):
    Bandit([A, B], window=10).load_state_dict(bandit.state_dict())


C = Strategy.parse("5_2_8")
ARMS = (None, A, B, C)
# Mean tokens/s of each arm (off, A, B, C) per bucket: a different best arm in each, SD off best
# where speculation is slower (the large buckets).
# The runner-up is 15-20% behind; rewards carry 30% noise.
TABLE = np.array([[100, 180, 150, 120],   # 1
                  [100, 125, 160, 110],   # 2-4
                  [100, 85, 80, 70],      # 5-20: SD off is faster
                  [100, 60, 50, 70]])     # 21+
ROWS = (1, 3, 12, 40)  # one active-row count in each bucket


def play(bandit, table, plays, rng):
  """`plays` rounds over every bucket with rewards mean * lognormal noise; the arms chosen, [plays, bucket]."""
  chosen = np.zeros((plays, len(ROWS)), np.int64)
  for t in range(plays):
    for b, rows in enumerate(ROWS):
      a = ARMS.index(bandit.choose(rows)[0])
      chosen[t, b] = a
      bandit.update(rows, ARMS[a], tokens=table[b, a] * rng.lognormal(0, 0.3), seconds=1.0)
  return chosen


def test_picks_the_best_arm_of_each_bucket_after_warmup():
  bandit, rng = Bandit(ARMS[1:], seed=0), np.random.default_rng(0)
  chosen = play(bandit, TABLE, 2300, rng)[300:]  # warm-up: the first window (300 plays per bucket)
  best = TABLE.argmax(1)
  share = (chosen == best).mean(0)
  assert (share >= 0.9).all(), share  # epsilon 0.1 over 4 arms: 92.5% expected
  assert best[2] == best[3] == 0  # SD off where speculation is slower...
  assert share[2] >= 0.9 and share[3] >= 0.9  # ...and the bandit switches speculation off there


@pytest.mark.parametrize("change", ["best_gets_worse", "another_gets_better"])
def test_moves_to_the_new_best_arm_when_rewards_change(change):
  bandit, rng = Bandit(ARMS[1:], seed=1), np.random.default_rng(1)
  play(bandit, TABLE, 600, rng)
  table = TABLE.copy()
  buckets = np.arange(len(ROWS))
  if change == "best_gets_worse":  # e.g. the drafter drifted away from the policy
    table[buckets, TABLE.argmax(1)] = 40
  else:  # e.g. a rarely played strategy gained from a better drafter
    table[buckets, TABLE.argmin(1)] = 300
  # A rarely played arm's median flips once most of its rewards in the bucket's horizon
  # (window x arms = 1200 plays) are new: after about half a horizon. Measured after 900 plays.
  chosen = play(bandit, table, 1800, rng)[900:]
  share = (chosen == table.argmax(1)).mean(0)
  assert (table.argmax(1) != TABLE.argmax(1)).all()
  assert (share >= 0.9).all(), share


def test_choose_among_allowed_arms():
  """Arms outside `allowed` are never played (a NaN drafter's); SD off always may be."""
  b = Bandit([A, B], epsilon=1.0, seed=0)
  played = set()
  for _ in range(100):
    arm, _ = b.choose(1, allowed=[B])
    b.update(1, arm, tokens=10, seconds=1.0)
    played.add(arm)
  assert played == {None, B}
