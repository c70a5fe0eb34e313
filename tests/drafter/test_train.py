"""EAGLE distillation: pairing, masking, frozen target, packing isolation, and that it learns."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.conftest import jit_prefill
from tlt_jax import packing
from tlt_jax.drafter import train
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import CausalLM, KVCache, ModelConfig

ROW_LEN = 32


@pytest.fixture(scope="module")
def target():
  cfg = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, tie_word_embeddings=True)
  return CausalLM(cfg, rngs=nnx.Rngs(0))


def random_sequences(n, seed=0):
  rng = np.random.default_rng(seed)
  return [(rng.integers(2, 64, rng.integers(2, 6)).tolist(), rng.integers(2, 64, rng.integers(3, 12)).tolist())
          for _ in range(n)]


class Oracle:
  """Stands in for a drafter and outputs fixed features (over the full vocabulary or `draft_vocab`)."""

  feature_layers = ()

  def __init__(self, out, draft_vocab=()):
    self.out = out
    self.draft_vocab = draft_vocab
    self.head = lambda target: Drafter.head(self, target)
    self.logits = lambda target, head, feats: Drafter.logits(self, target, head, feats)
    self.target_ids = lambda ids: Drafter.target_ids(self, ids)

  def target_features(self, hidden, aux):
    return hidden

  def empty_cache(self, batch, capacity, dtype):
    return None

  def __call__(self, target, features, tokens, positions, cache, mask):
    return self.out, cache


def test_pairing_is_feature_t_and_token_t_plus_1(target):
  prompt, response = [3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]
  seq = prompt + response
  n = len(seq)
  pairs = train.sequence_pairs(target, (), packing.pack([(prompt, response)], ROW_LEN))
  # f_0..f_{n-1} from the target alone (through the prefill path, not the packed one).
  f = jit_prefill(*nnx.split(target), jnp.asarray([seq]), jnp.asarray([n]), KVCache.zeros(target.config, 1, n)).hidden
  np.testing.assert_array_equal(pairs.tokens[0, :n - 1], seq[1:])
  np.testing.assert_array_equal(pairs.positions[0, :n], np.arange(n))
  np.testing.assert_array_equal(pairs.weights[0], [0] * 4 + [1] * 7 + [0] * (ROW_LEN - 11))
  np.testing.assert_allclose(pairs.hidden[0, :n], f[0], atol=1e-5)
  np.testing.assert_allclose(pairs.next_hidden[0, :n - 1], f[0, 1:], atol=1e-5)

  pad = lambda x: jnp.pad(x, ((0, 0), (0, ROW_LEN - x.shape[1]), (0, 0)))
  _, exact = train.loss_fn(Oracle(pad(f[:, 1:])), target, pairs)  # outputs f_{t+1} at pair t
  _, off_by_one = train.loss_fn(Oracle(pad(f)), target, pairs)  # outputs f_t: the reference's bug
  assert float(exact["feature_loss"]) < 1e-10 and float(exact["top1"]) == 1.0
  assert float(off_by_one["feature_loss"]) > 0.05 and float(off_by_one["logit_loss"]) > float(exact["logit_loss"])


def test_training_time_test_steps_are_what_a_draft_chain_computes(target):
  """Step k of training-time test at position t equals the k-th node of a draft chain rooted at
  t - k + 1 (the true pairs up to the root in the drafter's cache, then its own predictions fed back
  with the true next tokens), computed one node at a time through the drafter's cache as drafting
  does; step k's loss leaves out the first k - 1 positions of each sample."""
  prompt, response = [3, 4, 5], [8, 9, 10, 11, 12, 13, 14, 15]
  pairs = train.sequence_pairs(target, (), packing.pack([(prompt, response)], ROW_LEN))
  drafter = Drafter(target.config, rngs=nnx.Rngs(1))
  steps = train.step_predictions(drafter, target, pairs, 3)
  features = drafter.target_features(pairs.hidden, pairs.aux)
  for root in (0, 2, 6):
    n = root + 1
    causal = jnp.tril(jnp.ones((1, n, n), bool))
    out, cache = drafter(target, features[:, :n], pairs.tokens[:, :n], pairs.positions[:, :n],
                         drafter.empty_cache(1, ROW_LEN), causal)
    np.testing.assert_allclose(out[0, root], steps[0][0, root], atol=1e-5)
    predicted = out[:, root:root + 1]
    for k in (2, 3):
      cache = dataclasses.replace(cache, lengths=cache.lengths + (n if k == 2 else 1))
      at = root + k - 1
      predicted, cache = drafter(target, predicted, pairs.tokens[:, at:at + 1], pairs.positions[:, at:at + 1], cache,
                                 jnp.ones((1, 1, 1), bool))
      np.testing.assert_allclose(predicted[0, 0], steps[k - 1][0, at], atol=1e-5)
  # The metrics: the first step's loss, each step's top-1 over the pairs with k - 1 positions before them.
  loss, metrics = train.loss_fn(drafter, target, pairs, draft_steps=3)
  first, _ = train.loss_fn(drafter, target, pairs)
  assert set(metrics) == {"loss", "feature_loss", "logit_loss", "top1", "top1_2", "top1_3", "pairs"}
  np.testing.assert_allclose(metrics["loss"], first, rtol=1e-6)
  assert float(metrics["pairs"]) == len(response)  # x_{t+1} a response token: the prompt's last position on
  assert not np.isclose(float(loss), float(first))  # the objective weighs in the later steps


def test_reduced_vocabulary_top1_is_exact_in_evaluation(target):
  """A drafter predicting f_{t+1} exactly agrees with the target within its draft vocabulary on
  every pair; evaluated exactly, only where the target's own top token lies inside it."""
  sequences = random_sequences(6, seed=3)
  pairs = train.sequence_pairs(target, (), packing.pack(sequences, ROW_LEN))
  oracle = Oracle(pairs.next_hidden, draft_vocab=tuple(range(0, 64, 2)))
  _, cheap = train.loss_fn(oracle, target, pairs)
  _, exact = train.loss_fn(oracle, target, pairs, exact_top1=True)
  top = np.asarray(jnp.argmax(target.logits(pairs.next_hidden), -1))
  w = np.asarray(pairs.weights)
  assert float(cheap["top1"]) == 1.0
  np.testing.assert_allclose(float(exact["top1"]), ((top % 2 == 0) * w).sum() / w.sum(), rtol=1e-6)
  assert 0 < float(exact["top1"]) < 1


def test_frequent_tokens_are_the_draft_vocabulary():
  sequences = [([60, 61], [5, 5, 5, 9, 9, 3]), ([62], [9, 7, 7])]  # prompts do not count
  assert train.frequent_tokens(sequences, 64, 3) == (5, 7, 9)  # 9 x3, 5 x3, 7 x2: increasing ids
  assert train.frequent_tokens(sequences, 64, 4) == (3, 5, 7, 9)
  assert train.frequent_tokens(sequences, 64, 6) == (0, 1, 3, 5, 7, 9)  # unseen fill-ins by lower id
  assert train.coverage(sequences, (5, 9)) == pytest.approx(6 / 9)
  with pytest.raises(ValueError, match="65 tokens does not fit the target's vocabulary of 64"):
    train.frequent_tokens(sequences, 64, 65)


def test_a_head_chosen_by_coverage_is_the_fewest_frequent_tokens_reaching_it(monkeypatch):
  monkeypatch.setattr(train, "HEAD_MULTIPLE", 2)
  monkeypatch.setattr(train, "HEAD_CAP", 6)
  # 10 response tokens: 5 x4, 9 x3, 7 x2, 3 x1.
  sequences = [([60, 61], [5, 5, 5, 9, 9, 3]), ([62], [9, 7, 7, 5])]
  assert train.head_for_coverage(sequences, 64, 0.4) == ((5, 9), pytest.approx(0.7))  # 1 token, rounded up to 2
  assert train.head_for_coverage(sequences, 64, 0.7) == ((5, 9), pytest.approx(0.7))  # exactly reached
  assert train.head_for_coverage(sequences, 64, 0.71) == ((3, 5, 7, 9), 1.0)  # 3 tokens, rounded up to 4
  assert train.head_for_coverage(sequences, 64, 1.0) == ((3, 5, 7, 9), 1.0)
  monkeypatch.setattr(train, "HEAD_MULTIPLE", 16)
  monkeypatch.setattr(train, "HEAD_CAP", 64)
  assert train.head_for_coverage(sequences, 10, 0.71) == ((), 1.0)  # 16 tokens, not fewer than the vocabulary's 10
  monkeypatch.setattr(train, "HEAD_MULTIPLE", 2)
  monkeypatch.setattr(train, "HEAD_CAP", 2)
  assert train.head_for_coverage(sequences, 64, 1.0) == ((5, 9), pytest.approx(0.7))  # capped: less than asked
  for share in (0.0, 1.5):
    with pytest.raises(ValueError, match=r"coverage must lie in \(0, 1\]"):
      train.head_for_coverage(sequences, 64, share)
  # draft_head: -1 by coverage, 0 the whole vocabulary, N the N most frequent.
  assert train.draft_head(sequences, 64, -1, 0.4) == ((5, 9), pytest.approx(0.7))
  assert train.draft_head(sequences, 64, 0) == ((), 1.0)
  assert train.draft_head(sequences, 64, 3) == ((5, 7, 9), pytest.approx(0.9))


def test_reduced_vocabulary_distillation_learns(target):
  sequences = random_sequences(12)
  drafter = Drafter(target.config, draft_vocab=train.frequent_tokens(sequences, 64, 24), rngs=nnx.Rngs(1))
  before = train.evaluate(target, drafter, sequences, batch_rows=4, row_len=ROW_LEN)
  result = train.distill(target, drafter, sequences, steps=25, batch_rows=4, row_len=ROW_LEN, lr=3e-2,
                         eval_data=sequences)
  assert result.losses[-1] < result.losses[0] and result.eval["loss"] < before["loss"]
  assert result.eval["top1"] > before["top1"]


@pytest.fixture(scope="module")
def evaluate(target):
  """Jitted metrics of one fixed, untrained drafter."""
  drafter = Drafter(target.config, rngs=nnx.Rngs(1))
  fn = train.make_eval_step(drafter, target)
  _, dp = nnx.split(drafter)
  _, tp = nnx.split(target)
  return lambda pairs: {k: float(v) for k, v in fn(dp, tp, pairs).items()}


def test_prompt_pairs_do_not_contribute(target, evaluate):
  pairs = train.sequence_pairs(target, (), packing.pack(random_sequences(3), ROW_LEN))
  masked = (pairs.weights == 0)[..., None]
  noise = 10.0 * jax.random.normal(jax.random.key(0), pairs.next_hidden.shape)
  loss = evaluate(pairs)["loss"]
  assert evaluate(pairs.replace(next_hidden=jnp.where(masked, noise, pairs.next_hidden)))["loss"] == loss
  assert evaluate(pairs.replace(next_hidden=jnp.where(masked, pairs.next_hidden, noise)))["loss"] != loss


def test_packed_loss_is_token_weighted_mean_of_samples(target, evaluate):
  sequences = random_sequences(3, seed=1)
  assert packing.pack(sequences, ROW_LEN).shape[1] == 1  # all three share one row
  metrics = lambda seqs: evaluate(train.sequence_pairs(target, (), packing.pack(seqs, ROW_LEN)))
  packed = metrics(sequences)
  alone = [metrics([s]) for s in sequences]
  counts = np.asarray([m["pairs"] for m in alone])
  assert packed["pairs"] == counts.sum() == sum(len(r) for _, r in sequences)
  for key in ("loss", "feature_loss", "logit_loss"):
    np.testing.assert_allclose(packed[key], np.dot(counts, [m[key] for m in alone]) / counts.sum(), rtol=1e-5)


def test_distill_learns_and_leaves_the_target_alone(target):
  drafter = Drafter(target.config, rngs=nnx.Rngs(1))
  assert not any("embed_tokens" in str(path) for path, _ in nnx.to_flat_state(nnx.state(drafter)))
  sequences = random_sequences(12)
  before = train.evaluate(target, drafter, sequences, batch_rows=4, row_len=ROW_LEN)
  target_before = jax.tree.map(np.array, nnx.state(target))
  drafter_before = jax.tree.map(np.array, nnx.state(drafter))
  steps = []
  result = train.distill(target, drafter, sequences, steps=25, batch_rows=4, row_len=ROW_LEN, lr=3e-2,
                         eval_data=sequences, on_step=lambda i, m: steps.append(i))
  assert steps == list(range(25)) and len(result.losses) == len(result.metrics) == 25
  assert result.losses[-1] < result.losses[0]
  assert result.eval["feature_loss"] < 0.5 * before["feature_loss"] and result.eval["loss"] < before["loss"]
  assert result.eval["top1"] > 0.5 > before["top1"]
  # Gradients reach the drafter only: every drafter tensor moved, no target tensor did.
  jax.tree.map(np.testing.assert_array_equal, target_before, jax.tree.map(np.array, nnx.state(target)))
  after = jax.tree.map(np.array, nnx.state(drafter))
  moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), drafter_before, after)
  assert all(jax.tree.leaves(moved))


def test_eagle3_drafter_trains_on_the_logit_loss(target):
  drafter = Drafter(target.config, feature_layers=(0, 1, 2), rngs=nnx.Rngs(1))
  result = train.distill(target, drafter, random_sequences(4), steps=2, batch_rows=2, row_len=ROW_LEN, lr=1e-2)
  for m in result.metrics:
    assert np.isfinite(m["loss"]) and m["feature_loss"] > 0
    np.testing.assert_allclose(m["loss"], train.LOGIT_WEIGHT * m["logit_loss"], rtol=1e-6)
  for bad in ((0, 1, 3), (0, 1, 1)):
    with pytest.raises(ValueError, match=r"need 3 increasing indices of the target's 3 layers"):
      train.sequence_pairs(target, bad, packing.pack(random_sequences(1), ROW_LEN))


def test_the_acceptance_ceiling_of_a_drafter_that_is_the_target(target):
  """An oracle predicting the target's own next features has q = p: 1 - TV 1, its coupled draw (the draft
  tree's first child) always the target's, p(top-1 of q) the target's mean top probability; a random
  drafter falls far below (at a low temperature: this random target's distributions are near uniform
  at 1)."""
  pairs = train.sequence_pairs(target, (), packing.pack(random_sequences(6, seed=3), ROW_LEN))
  t = 0.05
  [oracle] = train.ceiling_metrics(train.ceiling_sums(Oracle(pairs.next_hidden), target, pairs, 1, t,
                                                     jax.random.key(0)))
  p = jax.nn.softmax(target.logits(pairs.next_hidden) / t, axis=-1)
  w = np.asarray(pairs.weights)
  top = np.sort(np.asarray(p), axis=-1)[..., ::-1]
  for k in (1, 2, 8):
    assert oracle[f"p_top{k}"] == pytest.approx((top[..., :k].sum(-1) * w).sum() / w.sum(), rel=1e-5)
  assert oracle["1-tv"] == pytest.approx(1.0, abs=1e-5) and oracle["coupled"] == 1.0 and oracle["pairs"] == w.sum()
  assert oracle["tree_top1"] == oracle["tree_top8"] == 1.0
  random = train.acceptance_ceiling(target, Drafter(target.config, rngs=nnx.Rngs(5)), pairs, temperature=t,
                                    draft_steps=2, batch_rows=2)
  assert len(random) == 2 and all(r["1-tv"] < oracle["1-tv"] - 0.1 and r["coupled"] < 0.9 for r in random)
  assert all(r["p_top1"] <= r["p_top2"] <= r["p_top8"] <= 1.0 for r in random)
  assert all(r["tree_top1"] == r["coupled"] and r["tree_top1"] <= r["tree_top2"] <= r["tree_top8"] <= 1.0
             for r in random)


def test_a_chains_acceptance_length_from_its_per_depth_rates():
  assert train.chain_accept_len([0.5, 0.5, 0.5]) == 1.875 and train.chain_accept_len([1.0] * 3) == 4.0
  assert train.chain_accept_len([0.0, 0.9]) == 1.0


def test_the_best_trees_acceptance_length_from_its_per_depth_rates():
  """The likeliest nodes: with the draw among a node's first 1 / 2 children at 0.5 / 0.75, a node's first
  child is reached half as often as the node, its second a quarter; one child a node is a chain."""
  assert train.tree_accept_len([[0.5, 0.75]], 2) == 1.75 and train.tree_accept_len([[0.5, 0.75]], 3) == 2.0
  assert train.tree_accept_len([[0.5] * 8] * 3, 3) == train.chain_accept_len([0.5] * 3)
  assert train.tree_accept_len([[1.0] * 8], 5) == 6.0 and train.tree_accept_len([[0.0] * 8], 5) == 1.0


def test_sampling_rollouts_train_two_draft_steps_unless_told():
  """train_drafter, the warm-up and the online trainer (draft_steps 0 by default) train a sampling
  rollout's drafter on two draft steps, a greedy one's on one; a number given is kept."""
  assert [train.sampling_draft_steps(0, t) for t in (0.0, 0.6, 1.0)] == [1, 2, 2]
  assert train.sampling_draft_steps(3, 0.0) == 3 and train.sampling_draft_steps(1, 1.0) == 1


def test_distillation_keeps_its_best_held_out_step_and_stops_when_it_stalls(target):
  """A few training sequences, others held out: the drafter ends with the parameters of its lowest held-out
  loss, and training stops `patience` evaluations after it (overfitting raises the held-out loss)."""
  train_seqs, held_out = random_sequences(2, seed=4), random_sequences(8, seed=5)
  drafter = Drafter(target.config, rngs=nnx.Rngs(2))
  before = train.evaluate(target, drafter, held_out, batch_rows=2, row_len=ROW_LEN)["loss"]
  result = train.distill(target, drafter, train_seqs, steps=200, batch_rows=2, row_len=ROW_LEN, lr=3e-2,
                         eval_data=held_out, eval_every=5, patience=3)
  steps, losses = zip(*result.eval_history)
  assert result.best_step == steps[int(np.argmin(losses))] and min(losses) < before
  assert len(result.losses) == steps[-1] + 1 < 200 and steps[-1] == result.best_step + 3 * 5  # stopped
  assert result.eval["loss"] == pytest.approx(min(losses), rel=1e-5)  # the drafter holds the best step's
  assert result.losses[-1] < result.losses[result.best_step]  # it went on fitting the training pairs
  # `epochs` caps the steps at that many passes over the rows, and the evaluations at one per pass.
  rows = train.all_pairs(target, (), train_seqs, row_len=ROW_LEN, batch_rows=1).tokens.shape[0]
  capped = train.distill(target, Drafter(target.config, rngs=nnx.Rngs(2)), train_seqs, steps=200, batch_rows=1,
                         row_len=ROW_LEN, lr=3e-2, eval_data=held_out, eval_every=100, epochs=2.5)
  assert capped.steps == len(capped.losses) == math.ceil(2.5 * rows) < 200
  assert [s for s, _ in capped.eval_history] == list(range(rows - 1, capped.steps - 1, rows)) + [capped.steps - 1]
