"""Per-step metrics: one JSON line per step in <workdir>/metrics.jsonl, TensorBoard scalars, and with
`logging.wandb` a Weights & Biases run (the `wandb` extra; `WANDB_MODE=offline` keeps it on disk).

Each step's first `logging.completions_per_step` responses are lines of <workdir>/completions.jsonl (the
step, prompt and sample, the prompt's and the response's text, reward, advantage, length, why it ended and
whether it was trained on), a TensorBoard text table and, with W&B, a table.

With tool turns, every tool call of a step's rollout (its name, arguments, result, error and time, with the
step, prompt and sample) is a line of <workdir>/tool_calls.jsonl.

On resume, records after the restored step (written by the interrupted run for steps it never
checkpointed) are dropped, so the file always describes one run's history; a resumed run logs to the
same W&B run (its id is kept in <workdir>/wandb_run_id).
"""

from __future__ import annotations

import json
import math
import os
import sys
import uuid
from typing import Sequence

import numpy as np

# tensorboardX imports torch where torch is installed (the GPU image, the test environment), only to take
# torch tensors, which this package never passes: 2.4-3.8 s of every start-up on a 2-core machine. Unless
# torch is loaded already, tensorboardX is imported with torch hidden (`sys.modules[name] = None` makes
# `import name` raise ImportError).
if "torch" in sys.modules:
  from tensorboardX import SummaryWriter
else:
  sys.modules["torch"] = None
  try:
    from tensorboardX import SummaryWriter
  finally:
    del sys.modules["torch"]


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


def wandb_run(workdir: str, project: str, entity: str = "", name: str = "", config: dict | None = None):
  """A W&B run logging into `project` (its files under `workdir`), resumed when the workdir has one."""
  try:
    import wandb  # pylint: disable=import-outside-toplevel  (the wandb extra)
  except ImportError:
    raise ValueError("config.logging.wandb=True needs the wandb package: pip install 'tlt_jax[wandb]'") from None
  id_path = os.path.join(workdir, "wandb_run_id")
  if os.path.exists(id_path):
    with open(id_path, encoding="utf-8") as f:
      run_id = f.read().strip()
  else:
    run_id = uuid.uuid4().hex[:8]
    with open(id_path, "w", encoding="utf-8") as f:
      f.write(run_id)
  return wandb.init(project=project, entity=entity or None, name=name or os.path.basename(os.path.abspath(workdir)),
                    id=run_id, resume="allow", dir=workdir, config=config)


COMPLETION_KEYS = ("prompt", "sample", "prompt_text", "completion", "reward", "advantage", "length", "finish_reason",
                   "trained")


def _keep(path: str, resume_step: int) -> None:
  """Drops the records of `path` after `resume_step` (creates it empty)."""
  kept = [r for r in read(path) if r["step"] <= resume_step] if os.path.exists(path) else []
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in kept)
  os.replace(tmp, path)


def _append(path: str, records: Sequence[dict]) -> None:
  try:
    with open(path, "a", encoding="utf-8") as f:
      f.writelines(json.dumps(r) + "\n" for r in records)
  except OSError as e:  # a full disk: name the file
    raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from None


class Writer:

  def __init__(self, workdir: str, resume_step: int = 0, wandb=None, tools: bool = False):
    """`wandb`: a W&B run (`wandb_run`) the records go to as well; `tools`: keep tool_calls.jsonl."""
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.completions_path = os.path.join(workdir, "completions.jsonl")
    self.calls_path = os.path.join(workdir, "tool_calls.jsonl") if tools else None
    for path in filter(None, (self.path, self.completions_path, self.calls_path)):
      _keep(path, resume_step)
    self.tensorboard = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1)
    self.wandb = wandb

  def write_calls(self, step: int, samples) -> None:
    """The tool calls of a step's rollout `samples` (their prompt index within the step)."""
    _append(self.calls_path, [{"step": step, "prompt": s.prompt_index, "sample": s.sample_index, **call}
                              for s in samples for call in s.tool_calls])

  def write_completions(self, step: int, rows: Sequence[dict]) -> None:
    """A step's responses (`COMPLETION_KEYS` each) as JSON lines, a TensorBoard text table and a W&B table."""
    if not rows:
      return
    _append(self.completions_path, [{"step": step, **r} for r in rows])
    cell = lambda v: (f"{v:.3f}" if isinstance(v, float) else str(v)).replace("|", "\\|").replace("\n", "<br>")
    table = ["| " + " | ".join(COMPLETION_KEYS) + " |", "|" + "---|" * len(COMPLETION_KEYS)]
    table += ["| " + " | ".join(cell(r[k]) for k in COMPLETION_KEYS) + " |" for r in rows]
    self.tensorboard.add_text("completions", "\n".join(table), step)
    if self.wandb is not None:
      import wandb  # pylint: disable=import-outside-toplevel  (the wandb extra, installed where a run is)
      self.wandb.log({"completions": wandb.Table(columns=["step", *COMPLETION_KEYS],
                                                 data=[[step, *(r[k] for k in COMPLETION_KEYS)] for r in rows])},
                     step=step, commit=False)

  def write(self, step: int, record: dict[str, float]) -> None:
    _append(self.path, [{"step": step, **record}])
    scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    for key, value in scalars.items():  # TensorBoard's names take no '@' (pass@k): it would log each rename
      self.tensorboard.add_scalar(key.replace("@", "_"), value, step)
    self.tensorboard.flush()
    if self.wandb is not None:
      self.wandb.log(scalars, step=step, commit=True)  # a record is a whole step

  def close(self) -> None:
    self.tensorboard.close()
    if self.wandb is not None:
      self.wandb.finish()
