"""BEG-MAB: a bucketed epsilon-greedy bandit choosing the decoding strategy per active-batch bucket.

Active batch sizes fall into buckets (TLT: [1], [2, 4], [5, 20], [21, ...]); each bucket keeps,
per arm, a sliding window of rewards (tokens emitted per second of a segment, measured after a
device sync). `choose` plays unseen arms first, then explores a uniformly random arm with
probability epsilon, else exploits the arm with the highest MEDIAN windowed reward. Unlike the
reference, every bucket also holds the "SD off" arm (`None`), so speculation switches itself off
wherever it loses. The state is a plain JSON-able dict (checkpointed with the run).
"""

from __future__ import annotations

import bisect
import collections
from typing import Any, Sequence

import numpy as np

from tlt_jax.rollout.speculative import Strategy

Arm = Strategy | None  # None: plain decoding ("SD off")


class Bandit:

  def __init__(self, strategies: Sequence[Strategy], thresholds: Sequence[int] = (1, 2, 5, 21),
               epsilon: float = 0.1, window: int = 300, seed: int = 0):
    if list(thresholds) != sorted(set(thresholds)) or not thresholds or thresholds[0] != 1:
      raise ValueError(f"bucket thresholds must increase from 1, got {list(thresholds)}")
    if not 0 <= epsilon <= 1:
      raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
    self.arms: tuple[Arm, ...] = (None, *strategies)
    self.thresholds = tuple(thresholds)
    self.epsilon, self.window = epsilon, window
    self._rng = np.random.default_rng(seed)
    self._rewards = [[collections.deque(maxlen=window) for _ in self.arms] for _ in self.thresholds]
    self._plays = np.zeros((len(self.thresholds), len(self.arms)), np.int64)

  def bucket(self, active_rows: int) -> int:
    return bisect.bisect_right(self.thresholds, active_rows) - 1

  def choose(self, active_rows: int) -> Arm:
    rewards = self._rewards[self.bucket(active_rows)]
    unseen = [i for i, r in enumerate(rewards) if not r]
    if unseen:
      return self.arms[unseen[0]]
    if self._rng.random() < self.epsilon:
      return self.arms[self._rng.integers(len(self.arms))]
    return self.arms[int(np.argmax([np.median(r) for r in rewards]))]

  def update(self, active_rows: int, arm: Arm, tokens: int, seconds: float) -> None:
    b, a = self.bucket(active_rows), self.arms.index(arm)
    self._rewards[b][a].append(tokens / max(seconds, 1e-9))
    self._plays[b, a] += 1

  def stats(self) -> dict[str, dict[str, dict[str, float]]]:
    """Per bucket ("5-20"), per arm ("off" or the strategy name): plays and median reward."""
    out = {}
    for b, lo in enumerate(self.thresholds):
      hi = self.thresholds[b + 1] - 1 if b + 1 < len(self.thresholds) else None
      label = f"{lo}+" if hi is None else str(lo) if hi == lo else f"{lo}-{hi}"
      out[label] = {
          _name(arm): {"plays": int(self._plays[b, a]),
                       "median_tokens_per_s": float(np.median(self._rewards[b][a])) if self._rewards[b][a] else 0.0}
          for a, arm in enumerate(self.arms)}
    return out

  def state_dict(self) -> dict[str, Any]:
    return {"arms": [_name(a) for a in self.arms], "thresholds": list(self.thresholds),
            "rewards": [[list(r) for r in bucket] for bucket in self._rewards], "plays": self._plays.tolist(),
            "rng": self._rng.bit_generator.state}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    if state["arms"] != [_name(a) for a in self.arms] or state["thresholds"] != list(self.thresholds):
      raise ValueError(f"bandit state for arms {state['arms']} / buckets {state['thresholds']} does not match "
                       f"{[_name(a) for a in self.arms]} / {list(self.thresholds)}")
    for bucket, saved in zip(self._rewards, state["rewards"]):
      for window, rewards in zip(bucket, saved):
        window.clear()
        window.extend(rewards)
    self._plays = np.asarray(state["plays"], np.int64)
    self._rng.bit_generator.state = state["rng"]


def _name(arm: Arm) -> str:
  return "off" if arm is None else arm.name
