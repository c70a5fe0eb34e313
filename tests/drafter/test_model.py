"""The EAGLE drafter reads the live policy's embedding and lm_head and owns only fc + one layer."""

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
