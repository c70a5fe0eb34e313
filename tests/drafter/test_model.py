"""The EAGLE drafter reads the live policy's embedding and lm_head and owns only fc + one layer."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter.model import Drafter
from tlt_jax.models import CausalLM, ModelConfig

CFG = ModelConfig("Qwen3ForCausalLM", vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True, tie_word_embeddings=True)


def run(drafter, target, tokens):
  b, t = tokens.shape
  feats = jnp.ones((b, t, CFG.hidden_size))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  out, cache = drafter(target, feats, tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), drafter.empty_cache(b, 8), mask)
  return out, cache


def test_parameters_are_fc_and_one_layer_only():
  drafter = Drafter(CFG, rngs=nnx.Rngs(0))
  names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(drafter, nnx.Param))}
  assert all(n.startswith(("fc/", "layer/")) for n in names)
  assert not any("input_layernorm" in n for n in names)  # EAGLE drops the layer's input norm
  assert "fc/kernel" in names and nnx.state(drafter, nnx.Param)["fc"]["kernel"].shape == (64, 32)


def test_reads_the_live_target_embedding():
  target, drafter = CausalLM(CFG, rngs=nnx.Rngs(0)), Drafter(CFG, rngs=nnx.Rngs(1))
  tokens = jnp.asarray([[3, 4, 5]])
  before, cache = run(drafter, target, tokens)
  assert cache.k.shape[0] == 1  # one layer of cache
  target.model.embed_tokens.embedding[...] = target.model.embed_tokens.embedding[...] * 2
  after, _ = run(drafter, target, tokens)
  assert not np.allclose(before, after)


def test_eagle3_fuses_three_target_layers():
  drafter = Drafter(CFG, feature_layers=(0, 1, 2), rngs=nnx.Rngs(1))
  aux = tuple(jnp.full((1, 2, 32), float(i)) for i in range(3))
  fused = drafter.target_features(jnp.zeros((1, 2, 32)), aux)
  assert fused.shape == (1, 2, 32) and not np.allclose(fused, 0)
  with pytest.raises(ValueError, match="three target layers"):
    Drafter(CFG, feature_layers=(0, 1), rngs=nnx.Rngs(1))


def test_reduced_vocabulary_head_is_the_live_lm_heads_rows():
  """Draft logits over N tokens equal the target's logits at those ids, for tied and untied heads,
  and follow the live weights; draft ids map back to target ids."""
  for tied in (True, False):
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
    target = CausalLM(cfg, rngs=nnx.Rngs(0))
    vocab = (1, 4, 9, 30, 39)
    drafter = Drafter(cfg, draft_vocab=vocab, rngs=nnx.Rngs(1))
    assert drafter.vocab_size == 5 and Drafter(cfg, rngs=nnx.Rngs(1)).vocab_size == 40
    feats = jnp.asarray(np.random.RandomState(0).randn(2, 3, 32), jnp.float32)
    full = np.asarray(target.logits(feats))
    np.testing.assert_allclose(drafter.logits(target, drafter.head(target), feats), full[..., list(vocab)], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(drafter.target_ids(jnp.asarray([0, 4, 2])), [1, 39, 9])
    target.model.embed_tokens.embedding[...] = target.model.embed_tokens.embedding[...] * 2
    if not tied:
      target.lm_head.kernel[...] = target.lm_head.kernel[...] * 2
    np.testing.assert_allclose(drafter.logits(target, drafter.head(target), feats), 2 * full[..., list(vocab)],
                               rtol=1e-5, atol=1e-5)
    full_head = drafter.with_full_vocab()  # the same layers, the whole vocabulary; the original unchanged
    assert full_head.vocab_size == 40 and drafter.vocab_size == 5 and full_head.head(target) is None
    np.testing.assert_array_equal(full_head.fc.kernel[...], drafter.fc.kernel[...])
    np.testing.assert_allclose(full_head.logits(target, None, feats), 2 * full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab, match", [(tuple(range(41)), "41 tokens is larger than the target's vocabulary of 40"),
                                          ((3, 40), "maps to target id 40, outside the target's vocabulary of 40"),
                                          ((-1, 3), "maps to target id -1"), ((5, 3), "strictly increasing")])
def test_bad_draft_vocabulary_is_refused(vocab, match):
  with pytest.raises(ValueError, match=match):
    Drafter(CFG, draft_vocab=vocab, rngs=nnx.Rngs(0))
