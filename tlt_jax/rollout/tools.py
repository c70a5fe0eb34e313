"""Multi-turn rollouts: the engine's side of tool calls.

A row decodes an assistant turn until its stop token; the engine then hands the turn's tokens to
`Turns.submit` (tlt_jax.rl.tools parses its tool calls and runs them in worker processes). A turn
that calls no tool finishes the row. Otherwise the row waits in its slot, its KV cache kept, while
the other rows decode on; once the calls' `Turn` is back, its tokens (the tool messages as the
chat template renders them, up to the next assistant turn's opening) are appended to the row
(`Steps.extend`: one forward of them, as if the row had decoded them) and it decodes its next turn.
Appended tokens count against the row's budget, are marked in `Sample.tool_mask` (no loss, no
drafter training on them) and get log-prob 0.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class Turn:
  """What a row's tool turn appends to it: `tokens`, the template's tokens that close the model's turn,
  the tool messages and the opening of the next assistant turn (int32); `calls`, a record per tool call."""

  tokens: np.ndarray
  calls: list[dict[str, Any]]


class Turns(abc.ABC):
  """The host's side of tool turns (tlt_jax.rl.tools implements it)."""

  max_turns: int  # assistant turns per trajectory at most (the last one's tool calls are not run)

  @abc.abstractmethod
  def submit(self, turn: np.ndarray) -> concurrent.futures.Future | None:
    """Starts the tool calls of an assistant turn that just ended (`turn`: its tokens, the stop token last);
    None when it calls no tool (the row is finished). The future's result is a `Turn`; it never raises."""
