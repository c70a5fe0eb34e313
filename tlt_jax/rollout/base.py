"""The rollout interface of the RL loop: every way of sampling an RL step's responses.

`PlainRollout` (tlt_jax.rollout.plain) runs one engine data-parallel over the devices; `TLTRollout`
(tlt_jax.rollout.tlt) runs one engine per device group with the speculative tail and trains the
drafter on the groups that finished. The RL trainer holds one for its steps and one for held-out
evaluations and never asks which kind.
"""

from __future__ import annotations

import abc
from typing import Callable, Sequence

from flax import nnx

from tlt_jax import checkpoint as rl_checkpoint
from tlt_jax import distributed
from tlt_jax.drafter.model import Drafter
from tlt_jax.executables import ExecutablePool
from tlt_jax.rollout import suffix
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.state import Sample


class BaseRollout(abc.ABC):
  """Samples responses with the policy's latest params; its state goes into RL checkpoints.

  Attributes:
    engines: this process's engines.
    groups: their rollout groups (global indices; every process's groups together are 0..G-1).
  """

  engines: list[Engine]
  groups: list[int]
  _history: suffix.History | None = None

  @property
  def history(self) -> suffix.History | None:
    """Each prompt's responses in earlier calls, for suffix drafts (`EngineConfig.suffix_history_len`
    > 0 with suffix strategies); None otherwise. The same in every process (all get every sample)."""
    cfg = self.engines[0].config
    if self._history is None and cfg.banking and cfg.suffix_history_len:
      self._history = suffix.History(cfg.suffix_history_len, cfg.suffix_ngram)
    return self._history

  def generate(self, prompts: Sequence[Sequence[int]], num_samples: int = 1,
               max_total_len: Sequence[int] | int | None = None, prompt_offset: int = 0,
               on_progress: Callable[[int, int], None] | None = None) -> tuple[list[Sample], dict[str, float]]:
    """Samples `num_samples` responses to each prompt (token ids); with a `history`, each prompt's
    earlier responses are in its bank (drafts change, samples do not) and its new ones join them.

    Args:
      prompts: the prompts' token ids.
      num_samples: responses per prompt.
      max_total_len: per prompt (or for all), the most prompt + response tokens; None: the
        sampling's max_new_tokens alone.
      prompt_offset: the prompts' index in the whole run (an RL loop passes the number of prompts
        sampled so far): each sample's RNG keys depend on it, never on the batching.
      on_progress: called by the engines as they go with (rows finished, tokens emitted) since the last call
        (from several threads when there are several engines).

    Returns:
      The samples in (prompt_index, sample_index) order, `prompt_index` counted from 0 within
      `prompts` (every process gets every sample), and the rollout's metrics (flat floats).
    """
    history = self.history
    banked = None if history is None else [history.get(p) for p in prompts]
    samples, metrics = self._generate(prompts, num_samples, max_total_len, prompt_offset, banked, on_progress)
    if history is not None:
      responses = [[] for _ in prompts]
      for s in samples:
        responses[s.prompt_index].append(s.tokens)
      for p, r in zip(prompts, responses):
        history.add(p, r)
      metrics["rollout/history_prompts"] = float(len(history))
    return samples, metrics

  @abc.abstractmethod
  def prepare(self, num_prompts: int, num_samples: int, first_group_only: bool = False) -> None:
    """Compiles every executable a call of `generate` with `num_prompts` prompts of any length (within
    the engines' max_prompt_len) and `num_samples` samples each runs (no-op for what is compiled): a later
    call of that size compiles nothing. `first_group_only`: only the first group's engine (a dry run's: the
    others compile the same for their own devices)."""

  def pools(self) -> dict[str, ExecutablePool]:
    """This process's executables, by owner: its first engine's ("engine"; the others' are compiled
    alike, for their own devices) and the drafter trainer's ("drafter")."""
    return {"engine": self.engines[0].pool}

  @abc.abstractmethod
  def _generate(self, prompts: Sequence[Sequence[int]], num_samples: int, max_total_len, prompt_offset: int,
                history: list | None,
                on_progress: Callable[[int, int], None] | None) -> tuple[list[Sample], dict[str, float]]:
    """`generate` without the history's upkeep: `history` (per prompt, or None) and `on_progress` go to the
    engines."""

  @abc.abstractmethod
  def set_policy_params(self, params: nnx.State) -> None:
    """New policy params (after an actor update) for the next `generate`. Where they are laid out as the
    engines need them the rollout keeps the caller's arrays (no second copy of the policy): the caller calls
    `release_policy_params` before it donates them."""

  def release_policy_params(self) -> None:
    """Drops the engines' copy of the policy (while the trainer updates it, the memory is the trainer's);
    `set_policy_params` gives them the next one, same shapes, nothing recompiled."""
    for engine in self.engines:
      engine.set_params(None)

  def drafter_model(self) -> Drafter | None:
    """The drafter this rollout speculates with, as trained so far (for the export); None without one."""
    return None

  def state_dict(self) -> tuple[dict, dict]:
    """(arrays, JSON-able metadata) for an RL checkpoint, merged into the trainer's. Here the
    bandits' states, in group order, and the history. Every process calls it at the same point."""
    local = [(g, e.bandit.state_dict()) for g, e in zip(self.groups, self.engines) if e.bandit is not None]
    bandits = sorted((item for part in distributed.allgather(local) for item in part), key=lambda item: item[0])
    arrays, meta = {}, {"bandits": [state for _, state in bandits]}
    if self.history is not None:
      arrays["suffix_history"], meta["suffix_history"] = rl_checkpoint.stack_processes(self.history.state_dict())
    return arrays, meta

  def abstract_state(self, metadata: dict) -> dict:
    """The shapes of the arrays `state_dict` returned with `metadata`, to restore them into."""
    spec = metadata.get("suffix_history")
    shapes = None if spec is None or self.history is None else rl_checkpoint.stacked_like(spec)
    return {} if shapes is None else {"suffix_history": shapes}

  def load_state_dict(self, arrays: dict, metadata: dict) -> None:
    """Restores what `state_dict` returned (`arrays` restored like `abstract_state(metadata)`); a
    checkpoint without a history this run can read leaves the history empty."""
    for g, engine in zip(self.groups, self.engines):  # every engine has a bandit, or none has
      if engine.bandit is not None:
        engine.bandit.load_state_dict(metadata["bandits"][g])
    if self.history is not None and "suffix_history" in arrays:
      self.history.load_state_dict(rl_checkpoint.unstack_processes(arrays["suffix_history"],
                                                                   metadata["suffix_history"]))

  def close(self) -> None:
    """Waits for what the rollout writes in the background."""
