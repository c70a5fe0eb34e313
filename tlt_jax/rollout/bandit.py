"""BEG-MAB: a bucketed epsilon-greedy bandit choosing the decoding strategy per active-batch bucket.

Active batch sizes fall into buckets (TLT: [1], [2, 4], [5, 20], [21, ...]). A play's reward is
the tokens it emitted per second of wall time per row active at its start, measured after a device
sync (the engine gives none for a play that is its executable's first run: one-time setup). Per
row, because a step costs about the same whatever the number of active rows in it (the executable
runs its padded batch): a bucket's raw tokens/s would favour whichever arm was played while more
rows were active (at 5-8 rows, up to 8/5 apart). Each bucket keeps
a sliding window of rewards: each arm's last `window` rewards, among the bucket's last
`window x arms` plays. `choose` plays arms with no reward in the window first, then explores a
uniformly random arm with probability epsilon, else exploits the arm with the highest MEDIAN
windowed reward; it says which plays explore, and the engine makes those short (a reward is a
rate, so a short play measures it too, at a fraction of a bad arm's cost). The bucket-wide
horizon makes rarely played arms' rewards expire too: a strategy that got better (a drafter
trained further) is re-learnt within about two windows of plays, and an arm the bucket never
chooses any more is retried once per horizon.
Unlike the reference, every bucket also holds the "SD off" arm (`None`), so speculation switches
itself off wherever it loses. The state is a plain JSON-able dict (checkpointed with the run).
"""

from __future__ import annotations

import bisect
import collections
from typing import Any, Sequence

import numpy as np

from tlt_jax import fields
from tlt_jax.rollout.speculative import Strategy

Arm = Strategy | None  # None: plain decoding ("SD off")


class Bandit:

  def __init__(self, strategies: Sequence[Strategy], thresholds: Sequence[int] = (1, 2, 5, 21),
               epsilon: float = 0.1, window: int = 300, seed: int = 0):
    """Config: `rollout.bandit` gives `thresholds` (of active rows), `epsilon` and `window`."""
    fields.require(list(thresholds)[:1] == [1] and all(a < b for a, b in zip(thresholds, thresholds[1:])),
                   "thresholds", tuple(thresholds), "must increase from 1")
    fields.require(0 <= epsilon <= 1, "epsilon", epsilon, "must be in [0, 1]")
    fields.require(window >= 1, "window", window, "must be >= 1")
    self.arms: tuple[Arm, ...] = (None, *strategies)
    self.thresholds = tuple(thresholds)
    self.epsilon, self.window = epsilon, window
    self._rng = np.random.default_rng(seed)
    # Per bucket: the last window x arms plays as (arm index, reward).
    self._plays_window = [collections.deque(maxlen=window * len(self.arms)) for _ in self.thresholds]
    self._plays = np.zeros((len(self.thresholds), len(self.arms)), np.int64)  # lifetime counts

  def bucket(self, active_rows: int) -> int:
    return bisect.bisect_right(self.thresholds, active_rows) - 1

  def label(self, bucket: int) -> str:
    """'1', '2-4', '5-20', '21+' for the default thresholds."""
    lo = self.thresholds[bucket]
    if bucket + 1 == len(self.thresholds):
      return f"{lo}+"
    hi = self.thresholds[bucket + 1] - 1
    return str(lo) if hi == lo else f"{lo}-{hi}"

  def _medians(self, bucket: int) -> list[float | None]:
    """Median windowed reward per arm; None for an arm with no play in the window."""
    rewards = [[] for _ in self.arms]
    for a, r in self._plays_window[bucket]:
      rewards[a].append(r)
    return [float(np.median(r[-self.window:])) if r else None for r in rewards]

  def choose(self, active_rows: int, allowed: Sequence[Arm] | None = None) -> tuple[Arm, bool]:
    """The arm of the next play at `active_rows`, among `allowed` (default: every arm; SD off always
    is), and whether the play explores (an arm without a reward in the window, or an epsilon pick)."""
    allowed = self.arms if allowed is None else (None, *(a for a in allowed if a is not None))
    index = [self.arms.index(a) for a in allowed]
    medians = [self._medians(self.bucket(active_rows))[i] for i in index]
    if None in medians:
      return allowed[medians.index(None)], True
    if self._rng.random() < self.epsilon:
      return allowed[self._rng.integers(len(allowed))], True
    return allowed[int(np.argmax(medians))], False

  def update(self, active_rows: int, arm: Arm, tokens: int, seconds: float) -> None:
    b, a = self.bucket(active_rows), self.arms.index(arm)
    self._plays_window[b].append((a, tokens / max(seconds, 1e-9) / max(active_rows, 1)))
    self._plays[b, a] += 1

  def stats(self) -> dict[str, dict[str, dict[str, float]]]:
    """Per bucket label, per arm ("off" or the strategy name): lifetime plays and windowed median reward
    (tokens/s per active row)."""
    out = {}
    for b in range(len(self.thresholds)):
      out[self.label(b)] = {
          _name(arm): {"plays": int(self._plays[b, a]), "median_tokens_per_s_per_row": m or 0.0}
          for a, (arm, m) in enumerate(zip(self.arms, self._medians(b)))}
    return out

  def state_dict(self) -> dict[str, Any]:
    """JSON-able: arm names, thresholds, window contents, lifetime plays, the RNG's state."""
    return {"arms": [_name(a) for a in self.arms], "thresholds": list(self.thresholds), "window": self.window,
            "plays_window": [[[a, r] for a, r in w] for w in self._plays_window], "plays": self._plays.tolist(),
            "rng": self._rng.bit_generator.state}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    mine = {"arms": [_name(a) for a in self.arms], "thresholds": list(self.thresholds), "window": self.window}
    theirs = {k: state.get(k) for k in mine}
    if theirs != mine:
      raise ValueError(f"bandit state for {theirs} does not match this bandit's {mine}")
    for w, saved in zip(self._plays_window, state["plays_window"]):
      w.clear()
      w.extend((int(a), float(r)) for a, r in saved)
    self._plays = np.asarray(state["plays"], np.int64).reshape(self._plays.shape)
    self._rng.bit_generator.state = state["rng"]


def _name(arm: Arm) -> str:
  return "off" if arm is None else arm.name
