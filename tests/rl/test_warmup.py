"""Warm-up on a target's own samples: held-out prompts, captured features, both heads from one sampling
(the CLI around it: tests/test_train_drafter.py)."""

import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter import train
from tlt_jax.rl import warmup
from tlt_jax.models import CausalLM, ModelConfig


@pytest.fixture(scope="module")
def own():
  cfg = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=48, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, tie_word_embeddings=True,
                    max_position_embeddings=64)
  model = CausalLM(cfg, rngs=nnx.Rngs(0))
  prompts = [[5, 17, 40, 9], [7, 3], [11, 12, 13], [30]]
  return model, warmup.sample(model, prompts, stop_ids=(1,), num_samples=2, temperature=1.0, max_new_tokens=10,
                              seed=0, eval_fraction=0.5)


def test_samples_split_into_training_and_held_out_prompts(own):
  _, samples = own
  train_samples, held = samples.split()
  assert samples.held_out == 2 and len(samples.samples) == 8
  assert {s.prompt_index for s in train_samples} == {0, 1} and {s.prompt_index for s in held} == {2, 3}
  assert samples.tokens == sum(len(s.tokens) for s in samples.samples)
  pairs = samples.pairs(train_samples, row_len=32)  # a target per response token of each training sample, less one
  assert pairs.weights.sum() == sum(len(s.tokens) - 1 for s in train_samples)


def test_full_and_reduced_heads_distil_from_one_sampling(own, monkeypatch):
  model, samples = own
  full, full_summary = warmup.distil(model, samples, steps=2, batch_rows=2, row_len=32, lr=1e-3, draft_vocab_size=0)
  reduced, summary = warmup.distil(model, samples, steps=2, batch_rows=2, row_len=32, lr=1e-3, draft_vocab_size=8)
  assert full.vocab_size == full_summary["draft_vocab_size"] == 48
  assert "draft_vocab_coverage_heldout" not in full_summary
  train_samples, held = samples.split()
  train_seqs = samples.sequences(train_samples)
  assert reduced.draft_vocab == train.frequent_tokens(train_seqs, 48, 8)
  assert summary["draft_vocab_size"] == 8
  assert summary["draft_vocab_coverage"] == round(train.coverage(train_seqs, reduced.draft_vocab), 4)
  coverage = train.coverage(samples.sequences(held), reduced.draft_vocab)
  assert summary["draft_vocab_coverage_heldout"] == round(coverage, 4)
  # By default the head is chosen by coverage: the fewest tokens (whole multiples) covering 99% of the training
  # responses; at the real multiple of 256 that is this small vocabulary's whole.
  default, default_summary = warmup.distil(model, samples, steps=1, batch_rows=2, row_len=32, lr=1e-3)
  assert default.draft_vocab == () and default_summary["draft_vocab_size"] == 48
  monkeypatch.setattr(train, "HEAD_MULTIPLE", 4)
  chosen, chosen_summary = warmup.distil(model, samples, steps=1, batch_rows=2, row_len=32, lr=1e-3,
                                         head_coverage=0.5)
  assert chosen.draft_vocab == train.head_for_coverage(train_seqs, 48, 0.5)[0] and len(chosen.draft_vocab) % 4 == 0
  assert 0.5 <= chosen_summary["draft_vocab_coverage"] < 1 and len(chosen.draft_vocab) < 48
  for s in (full_summary, summary):
    assert s["train_sequences"] == s["eval_sequences"] == 4 and s["steps"] == 2
    assert np.isfinite([s["loss_first"], s["loss_last"], s["loss_heldout"]]).all() and 0 <= s["top1_heldout"] <= 1
