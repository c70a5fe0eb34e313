"""The actor: packed log-probs against transformers, chunking / remat invariance, micro-batch invariance."""

import jax
import numpy as np
import optax
import torch

from tlt_jax import packing
from tlt_jax.models import hf
from tlt_jax.rl import actor as actor_lib

SEQS = [([3, 17, 9], [44, 2, 61, 8]), ([5, 6], [70, 71, 72, 73, 74, 75]), ([9, 9, 9, 4], [12, 1]),
        ([30], [31, 32, 33])]


def _torch_logprobs(torch_model, seq):
  with torch.no_grad():
    logits = torch_model(torch.tensor([seq])).logits[0].double()
  logp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
  return logp.numpy()


def test_packed_logprobs_match_transformers_per_sample(hf_dirs):
  path, torch_model = hf_dirs["qwen2_untied"]
  model = hf.from_pretrained(path)
  rows = packing.pack(SEQS, 16, index=True)
  for chunk in (1024, 5):  # one LM-head chunk, or several with padding
    logp, entropy = jax.jit(lambda r: actor_lib.token_logprobs(model, r[0], r[1], r[2], chunk=chunk))(rows)
    for i, (prompt, response) in enumerate(SEQS):
      r, slots = np.nonzero(rows[4] == i + 1)
      seq = prompt + response
      np.testing.assert_allclose(np.asarray(logp)[r[1:], slots[1:]], _torch_logprobs(torch_model, seq), atol=1e-4)
    assert np.all(np.asarray(entropy)[rows[3] > 0] > 0)


def _actor(model, micro_batch_rows, long_rows=False):
  """`long_rows`: the memory savers of long-sequence training (remat, attention by query blocks)."""
  return actor_lib.Actor(model, optax.sgd(0.1), micro_batch_rows=micro_batch_rows, clip_low=0.2, clip_high=0.28,
                         remat=long_rows, logits_chunk=4, attention_block=4 if long_rows else None)


def test_micro_batching_remat_and_query_blocks_do_not_change_the_update(hf_dirs):
  path, _ = hf_dirs["qwen3"]
  rows = packing.pack(SEQS, 8, index=True)  # 4 rows of 8 tokens
  adv = np.array([1.0, -0.5, 0.25, -1.0], np.float32)
  results = []
  for micro, long_rows in ((4, False), (1, True)):
    actor = _actor(hf.from_pretrained(path), micro, long_rows)
    old = actor.logprobs(actor.params, rows) - 0.5  # ratio 1.65: positive advantages clip
    batch = actor_lib.training_batch(rows, adv, np.ones(4, bool), "sequence", old, None)
    stats = actor.update(batch)
    results.append((jax.tree.leaves(actor.params), stats))
  (ref_params, ref_stats), *others = results
  for params, stats in others:
    for a, b in zip(ref_params, params):
      np.testing.assert_allclose(a, b, atol=1e-6)
    for k in ("loss", "clip_frac", "entropy", "grad_norm"):
      np.testing.assert_allclose(stats[k], ref_stats[k], rtol=1e-5)
  assert ref_stats["grad_norm"] > 0 and 0 < ref_stats["clip_frac"] < 1


def test_a_non_finite_gradient_leaves_params_and_optimizer_state_alone(hf_dirs):
  """The update step itself (a NaN loss is skipped before it: tests/rl/test_trainer.py)."""
  actor = actor_lib.Actor(hf.from_pretrained(hf_dirs["qwen3"][0]), optax.adam(0.1), micro_batch_rows=4,
                          clip_low=0.2, clip_high=0.28)
  before = jax.tree.map(np.asarray, (actor.params, actor.opt_state))
  grads = jax.tree.map(lambda x: np.full(x.shape, 0.5, x.dtype), actor.params)
  leaf = jax.tree.leaves(grads)[0]
  leaf.flat[0] = np.inf
  actor.params, actor.opt_state, norm = actor._apply(actor.params, actor.opt_state, grads)
  assert not np.isfinite(norm)
  after = jax.tree.map(np.asarray, (actor.params, actor.opt_state))
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), before, after)))
  leaf.flat[0] = 0.5
  actor.params, actor.opt_state, norm = actor._apply(actor.params, actor.opt_state, grads)
  assert np.isfinite(norm) and not np.array_equal(jax.tree.leaves(actor.params)[0], jax.tree.leaves(before[0])[0])
