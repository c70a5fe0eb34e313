"""Offline drafter warm-up on a target's own samples (the library behind `python -m tlt_jax.train_drafter`).

`sample` draws responses from the target with the rollout engine, its features captured while decoding
(no recomputation, as the online trainer gets them), and holds the last prompts' out; `distil` trains a
fresh drafter on them (`tlt_jax.drafter.train`). One `sample`, then as many drafters as wanted: EAGLE or
EAGLE-3 (which recomputes the three target layers the rollout does not keep), the target's whole
vocabulary or a reduced head over the most frequent response tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from flax import nnx

from tlt_jax.drafter import train
from tlt_jax.drafter.buffer import BufferConfig, DataBuffer
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import CausalLM
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.state import EngineConfig, Sample

ROLLOUT_ROWS = 64  # rows decoded together at most
# The acceptance figures per draft step a sampled-response drafter's summary reports.
SUMMARY_CEILING = ("1-tv", "p_top1", "p_top4", "p_top8", "tree_top4", "tree_top8", "coupled")


@dataclasses.dataclass
class OwnSamples:
  """The target's responses to `prompts`; those of the last `held_out` prompts are held out."""

  prompts: list[list[int]]
  samples: list[Sample]  # in (prompt, sample) order, with the features the rollout captured
  held_out: int
  tokens: int  # response tokens in all

  def split(self) -> tuple[list[Sample], list[Sample]]:
    """(training samples, held-out samples)."""
    first = len(self.prompts) - self.held_out
    return ([s for s in self.samples if s.prompt_index < first], [s for s in self.samples if s.prompt_index >= first])

  def sequences(self, samples: Sequence[Sample]) -> train.Sequences:
    return [(self.prompts[s.prompt_index], s.tokens.tolist()) for s in samples]

  def pairs(self, samples: Sequence[Sample], row_len: int) -> train.Pairs:
    """Training pairs of `samples` from the features their rollout captured, packed into rows of `row_len`."""
    buffer = DataBuffer(BufferConfig(max_pairs=sum(len(self.prompts[s.prompt_index]) + len(s.tokens)
                                                   for s in samples), eval_every=0))
    buffer.add(0, samples, self.prompts)
    return buffer.packed(row_len)


def sample(model: CausalLM, prompts: Sequence[Sequence[int]], *, stop_ids: Sequence[int], num_samples: int,
           temperature: float, max_new_tokens: int, seed: int, eval_fraction: float = 0.0,
           capture_hidden: bool = True, on_progress: Callable[[int, int], None] | None = None) -> OwnSamples:
  """`num_samples` responses to each prompt, each of at most `max_new_tokens` and what the model's
  positions leave after its prompt; the last `int(len(prompts) * eval_fraction)` prompts' are held out."""
  prompts = [list(p) for p in prompts]
  rows = min(len(prompts) * num_samples, ROLLOUT_ROWS)
  engine = Engine(model, EngineConfig(batch_buckets=tuple(2**i for i in range((rows - 1).bit_length() + 1)),
                                      max_prompt_len=max(map(len, prompts)), max_new_tokens=max_new_tokens,
                                      capture_hidden=capture_hidden),
                  SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                                 stop_token_ids=tuple(sorted(set(stop_ids))), seed=seed))
  rollout = engine.generate(prompts, num_samples=num_samples, max_total_len=model.config.max_position_embeddings,
                            on_progress=on_progress)
  return OwnSamples(prompts, rollout.samples, int(len(prompts) * eval_fraction), rollout.metrics.tokens)


def distil(model: CausalLM, own: OwnSamples, *, steps: int, batch_rows: int, row_len: int, lr: float,
           feature_layers: Sequence[int] = (), draft_vocab_size: int = -1, head_coverage: float = train.HEAD_COVERAGE,
           draft_steps: int = 1, temperature: float = 0.0, eval_every: int = 0, patience: int = 0, epochs: float = 0.0,
           seed: int = 0, on_step: Callable[[int, dict[str, float]], None] | None = None) -> tuple[Drafter, dict]:
  """A fresh drafter distilled on `own`'s training samples, and a summary: its shape, the loss curve's
  ends, top-1 agreement (held out when `own` holds prompts out) and a reduced head's coverage of the
  training and held-out response tokens. `draft_vocab_size`: -1 chooses the head by `head_coverage`,
  0 is the whole vocabulary, N the N most frequent training response tokens (`train.draft_head`).
  `draft_steps`: the training-time test's steps (`train.loss_fn`); top-1 is reported at each of
  `train.EVAL_STEPS` draft steps. `temperature`: the rollout's the drafter will serve (the loss's:
  `train.sampling_loss`); held out, training keeps its best step (`eval_every`, `patience`:
  `train.distill`, as `epochs`), and at a temperature > 0 the summary says what verification can accept
  (`train.acceptance_ceiling` per draft step, on the held-out samples)."""
  train_samples, eval_samples = own.split()
  train_seqs, eval_seqs = own.sequences(train_samples), own.sequences(eval_samples)
  vocab, covered = train.draft_head(train_seqs, model.config.vocab_size, draft_vocab_size, head_coverage)
  if feature_layers:  # EAGLE-3 features: recomputed
    data, eval_data = train_seqs, eval_seqs
  else:
    data = own.pairs(train_samples, row_len)
    eval_data = own.pairs(eval_samples, row_len) if eval_samples else ()
  drafter = Drafter(model.config, feature_layers=feature_layers, draft_vocab=vocab, rngs=nnx.Rngs(seed))
  loss = train.sampling_loss(temperature)
  result = train.distill(model, drafter, data, steps=steps, batch_rows=batch_rows, row_len=row_len, lr=lr, seed=seed,
                         eval_data=eval_data, draft_steps=draft_steps, eval_every=eval_every, patience=patience,
                         epochs=epochs, on_step=on_step, **loss)
  summary = {"train_sequences": len(train_seqs), "eval_sequences": len(eval_seqs),
             "feature_layers": list(feature_layers), "draft_vocab_size": drafter.vocab_size, "steps": result.steps,
             "steps_run": len(result.losses), "best_step": result.best_step + 1, "draft_steps": draft_steps,
             "loss_temperature": loss["temperature"], "logit_weight": loss["logit_weight"],
             "loss_first": result.losses[0], "loss_last": result.losses[-1], "top1_last": result.metrics[-1]["top1"]}
  if result.eval is not None:
    summary["top1_heldout"] = result.eval["top1"]
    summary.update({f"top1_{k}_heldout": result.eval[f"top1_{k}"] for k in range(2, train.EVAL_STEPS + 1)})
    summary["loss_heldout"] = result.eval["loss"]
    summary["loss_heldout_history"] = [[step + 1, round(loss, 4)] for step, loss in result.eval_history]
    if temperature > 0:
      ceiling = train.acceptance_ceiling(model, drafter, eval_data, temperature=temperature, row_len=row_len)
      summary["heldout_acceptance_per_draft_step"] = [
          {k: round(v, 4) for k, v in c.items() if k in SUMMARY_CEILING} for c in ceiling]
      rates = [c["coupled"] for c in ceiling]  # a sampled chain's drafts: the coupled draws
      summary["heldout_tree_accept_len"] = {v: round(n, 3) for v, n in train.best_trees(ceiling).items()}
    else:
      rates = [result.eval["top1"]] + [result.eval[f"top1_{k}"] for k in range(2, train.EVAL_STEPS + 1)]
    summary["heldout_chain_accept_len"] = round(train.chain_accept_len(rates), 3)
  if vocab:
    summary["draft_vocab_coverage"] = round(covered, 4)
    summary["draft_vocab_coverage_heldout"] = round(train.coverage(eval_seqs or train_seqs, vocab), 4)
  return drafter, summary
