"""BEG-MAB: a bucketed epsilon-greedy bandit choosing the decoding strategy per active-batch bucket.

Active batch sizes fall into buckets (TLT: [1], [2, 4], [5, 20], [21, ...]). A play reports the
tokens it emitted per row active at its start, its decode steps and its wall time, measured after a
device sync (the engine reports no play that is its executable's first run: one-time setup). Per
row, because a step costs about the same whatever the number of active rows in it (the executable
runs its padded batch): a bucket's raw tokens/s would favour whichever arm was played while more
rows were active (at 5-8 rows, up to 8/5 apart). Each bucket keeps a sliding window of plays: each
arm's last `window`, among the bucket's last `window x arms` plays. An arm's reward is its tokens
per second per row over its window, as the window's mean tokens per row and step over its MEDIAN
seconds per step: the time carries the machine's noise (the median drops a stalled play), the
tokens are the text's (a speculative arm's tokens a step are right-skewed: the reference's median
of per-play rates reads such an arm below its throughput, 4-5% on SmolLM2, BENCHMARKS.md).
`choose` plays arms with no reward in the window first, then explores a uniformly random arm with
probability epsilon, else exploits the arm with the highest reward; it says which plays explore,
and the engine makes those short (a reward is a rate, so a short play measures it too, at a
fraction of a bad arm's cost). The bucket-wide horizon makes rarely played arms' rewards expire
too: a strategy that got better (a drafter trained further) is re-learnt within about two windows
of plays, and an arm the bucket never chooses any more is retried once per horizon.
Unlike the reference, every bucket also holds the "SD off" arm (`None`), so speculation switches
itself off wherever it loses. The state is a plain JSON-able dict (checkpointed with the run).
"""

from __future__ import annotations

import bisect
import collections
import statistics
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
    # Per bucket: the last window x arms plays as (arm index, tokens per row, steps, seconds).
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

  def _rewards(self, bucket: int) -> list[float | None]:
    """Per arm, over its plays in the window: mean tokens per row and step / median seconds per step
    (tokens/s per row); None for an arm with no play in the window."""
    plays = [[] for _ in self.arms]
    for play in self._plays_window[bucket]:
      plays[play[0]].append(play)
    return [_reward(p[-self.window:]) if p else None for p in plays]

  def choose(self, active_rows: int, allowed: Sequence[Arm] | None = None) -> tuple[Arm, bool]:
    """The arm of the next play at `active_rows`, among `allowed` (default: every arm; SD off always
    is), and whether the play explores (an arm without a reward in the window, or an epsilon pick)."""
    allowed = self.arms if allowed is None else (None, *(a for a in allowed if a is not None))
    index = [self.arms.index(a) for a in allowed]
    windowed = self._rewards(self.bucket(active_rows))
    rewards = [windowed[i] for i in index]
    if None in rewards:
      return allowed[rewards.index(None)], True
    if self._rng.random() < self.epsilon:
      return allowed[self._rng.integers(len(allowed))], True
    return allowed[int(np.argmax(rewards))], False

  def update(self, active_rows: int, arm: Arm, tokens: int, seconds: float, steps: int = 1) -> None:
    """A play of `arm` that began with `active_rows` rows active: `tokens` emitted in `steps` decode
    steps (speculative iterations or plain steps) and `seconds`."""
    b, a = self.bucket(active_rows), self.arms.index(arm)
    self._plays_window[b].append((a, tokens / max(active_rows, 1), max(steps, 1), max(seconds, 1e-9)))
    self._plays[b, a] += 1

  def stats(self) -> dict[str, dict[str, dict[str, float]]]:
    """Per bucket label, per arm ("off" or the strategy name): lifetime plays and windowed reward
    (tokens/s per active row)."""
    out = {}
    for b in range(len(self.thresholds)):
      out[self.label(b)] = {
          _name(arm): {"plays": int(self._plays[b, a]), "tokens_per_s_per_row": r or 0.0}
          for a, (arm, r) in enumerate(zip(self.arms, self._rewards(b)))}
    return out

  def state_dict(self) -> dict[str, Any]:
    """JSON-able: arm names, thresholds, window contents, lifetime plays, the RNG's state."""
    return {"arms": [_name(a) for a in self.arms], "thresholds": list(self.thresholds), "window": self.window,
            "plays_window": [[list(play) for play in w] for w in self._plays_window], "plays": self._plays.tolist(),
            "rng": self._rng.bit_generator.state}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    mine = {"arms": [_name(a) for a in self.arms], "thresholds": list(self.thresholds), "window": self.window}
    theirs = {k: state.get(k) for k in mine}
    if theirs != mine:
      raise ValueError(f"bandit state for {theirs} does not match this bandit's {mine}")
    for w, saved in zip(self._plays_window, state["plays_window"]):
      w.clear()  # a state from before plays held their steps and seconds: [arm, rate], one step of 1 s
      w.extend((int(p[0]), float(p[1]), int(p[2]), float(p[3])) if len(p) == 4 else (int(p[0]), float(p[1]), 1, 1.0)
               for p in saved)
    self._plays = np.asarray(state["plays"], np.int64).reshape(self._plays.shape)
    self._rng.bit_generator.state = state["rng"]


def _reward(plays: list[tuple[int, float, int, float]]) -> float:
  """Tokens/s per row of (arm, tokens per row, steps, seconds) plays: mean tokens a step / median seconds a step."""
  steps = sum(p[2] for p in plays)
  return sum(p[1] for p in plays) / steps / statistics.median(p[3] / p[2] for p in plays)


def _name(arm: Arm) -> str:
  return "off" if arm is None else arm.name
