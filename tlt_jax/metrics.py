"""Per-step metrics: one JSON line per step in <workdir>/metrics.jsonl and TensorBoard scalars.

On resume, records after the restored step (written by the interrupted run for steps it never
checkpointed) are dropped, so the file always describes one run's history.
"""

from __future__ import annotations

import json
import math
import os
from typing import Sequence

import numpy as np
from tensorboardX import SummaryWriter


def group_means(scores: Sequence[float], groups: Sequence[int]) -> list[float]:
  """The mean score of each group (e.g. a prompt's samples), in the groups' sorted order."""
  _, index = np.unique(np.asarray(groups), return_inverse=True)
  return (np.bincount(index, np.asarray(scores, np.float64)) / np.bincount(index)).tolist()


def ci95(values: Sequence[float]) -> float:
  """Half-width of the normal 95% interval of the mean of independent `values` (0 for fewer than two)."""
  values = np.asarray(values, np.float64)
  return float(1.96 * values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0


def read(path: str) -> list[dict]:
  """The records; a last line cut short (a run killed while writing it) is dropped."""
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")  # the last item is "" when the file ends with a newline
  return [json.loads(line) for line in lines[:-1] if line.strip()]


class Writer:

  def __init__(self, workdir: str, resume_step: int = 0):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    kept = [r for r in read(self.path) if r["step"] <= resume_step] if os.path.exists(self.path) else []
    tmp = self.path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, self.path)
    self.tensorboard = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1)

  def write(self, step: int, record: dict[str, float]) -> None:
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps({"step": step, **record}) + "\n")
    for key, value in record.items():
      if isinstance(value, (int, float)) and math.isfinite(value):
        self.tensorboard.add_scalar(key, value, step)
    self.tensorboard.flush()

  def close(self) -> None:
    self.tensorboard.close()
