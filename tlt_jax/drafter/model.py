"""EAGLE-style drafter: one decoder layer fed by the target's features.

At position t the drafter reads `fc(concat(embed(x_{t+1}), f_t))` (2H -> H), where f_t is the
target's feature at t, runs one decoder layer without input norm (and no final norm) and
predicts f_{t+1}; logits come from the TARGET's lm_head. Embedding and lm_head are the live
policy's own: they are passed in at every call, never copied, so they follow the policy as RL
changes it. Only `fc` and the layer are trainable.

A reduced-vocabulary head (`draft_vocab`, the idea of FR-Spec and of EAGLE-3's `draft_vocab_size`):
the drafter scores only N target tokens, the most frequent ones of the data it was distilled on,
with the live lm_head's rows for them; draft candidates are mapped back to target ids. For a
small target the full head is most of a draft step's cost (SmolLM2-135M: a 49k x 576 head beside
a 4M-parameter layer). Verification is unchanged, so speculative decoding stays lossless.

EAGLE-3 (`feature_layers` set): the target feature is a learned fusion of three target layers
(low, mid, high) instead of its last hidden state; deeper tree levels feed the drafter its own
output, as in EAGLE-3.
"""

from __future__ import annotations

import dataclasses

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import CausalLM, DecoderLayer, KVCache, linear, rope_tables


def check_draft_vocab(vocab_size: int, draft_vocab: Sequence[int]) -> None:
  """A draft vocabulary is a strictly increasing set of target token ids (EAGLE-3's d2t order)."""
  ids = list(draft_vocab)
  if len(ids) > vocab_size:
    raise ValueError(f"a draft vocabulary of {len(ids)} tokens is larger than the target's vocabulary of {vocab_size}")
  outside = [i for i in (min(ids, default=0), max(ids, default=0)) if not 0 <= i < vocab_size]
  if outside:
    raise ValueError(f"the draft vocabulary ({len(ids)} tokens) maps to target id {outside[0]}, outside the target's "
                     f"vocabulary of {vocab_size}")
  if ids != sorted(set(ids)):
    raise ValueError("a draft vocabulary must be strictly increasing target ids")


def check_feature_layers(num_layers: int, feature_layers: Sequence[int]) -> None:
  """EAGLE-3 fuses three increasing target layers (the target returns their outputs in order)."""
  layers = list(feature_layers)
  if layers and (len(layers) != 3 or layers != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] < num_layers):
    raise ValueError(f"EAGLE-3 fuses three target layers (low, mid, high): need 3 increasing indices of the "
                     f"target's {num_layers} layers, got {layers}")


class Drafter(nnx.Module):

  def __init__(self, target: ModelConfig, *, feature_layers: Sequence[int] = (), draft_vocab: Sequence[int] = (),
               dtype=jnp.float32, rngs: nnx.Rngs):
    h = target.hidden_size
    self.config = target
    check_feature_layers(target.num_layers, feature_layers)
    check_draft_vocab(target.vocab_size, draft_vocab)
    self.feature_layers = tuple(feature_layers)
    self.draft_vocab = tuple(int(i) for i in draft_vocab)  # () = the target's whole vocabulary
    self.fuse = linear(3 * h, h, ("embed", "embed"), False, dtype, rngs) if self.feature_layers else None
    self.fc = linear(2 * h, h, ("embed", "embed"), True, dtype, rngs)
    self.layer = DecoderLayer(target, dtype, rngs, input_norm=False)

  @property
  def vocab_size(self) -> int:
    """Tokens the drafter scores: N of a reduced head, else the target's vocabulary."""
    return len(self.draft_vocab) or self.config.vocab_size

  def head(self, target: CausalLM) -> jax.Array | None:
    """The live lm_head's rows of the draft vocabulary, [H, N] (None: the full head). Gather it once
    per executable and pass it to `logits`: it is a slice of the target's weights, never a copy kept."""
    if not self.draft_vocab:
      return None
    ids = jnp.asarray(self.draft_vocab, jnp.int32)
    if target.config.tie_word_embeddings:
      return target.model.embed_tokens.embedding[ids].T
    return target.lm_head.kernel[:, ids]

  def logits(self, target: CausalLM, head_HxN: jax.Array | None, features) -> jax.Array:
    """Float32 draft logits over the drafter's vocabulary ([..., N]; draft id i is target id
    `draft_vocab[i]`)."""
    if head_HxN is None:
      return target.logits(features)
    return jnp.dot(features.astype(head_HxN.dtype), head_HxN).astype(jnp.float32)

  def with_full_vocab(self) -> "Drafter":
    """The same trained layers scoring the target's whole vocabulary (a reduced head's comparison)."""
    full = nnx.clone(self)
    full.draft_vocab = ()
    return full

  def target_ids(self, draft_ids):
    """Target token ids of draft ids."""
    if not self.draft_vocab:
      return draft_ids
    return jnp.asarray(self.draft_vocab, jnp.int32)[draft_ids]

  def target_features(self, hidden_BxTxH, aux_hidden: tuple[jax.Array, ...]) -> jax.Array:
    """The drafter's view of the target at each position: its last hidden state, or (EAGLE-3)
    the fusion of the `feature_layers` outputs (request them with `hidden_layers`)."""
    if self.fuse is None:
      return hidden_BxTxH
    return self.fuse(jnp.concatenate(aux_hidden, axis=-1))

  def __call__(self, target: CausalLM, features_BxTxH, tokens_BxT, positions_BxT, cache: KVCache, mask_BxTxW, *,
               kv_block: int | None = None, attention: str = "auto"):
    """Predicted next features [B, T, H] and the drafter cache with the new pairs written.

    Pair t is (feature f_p, token x_{p+1}) at position p = positions_BxT[:, t].
    """
    embed = target.model.embed_tokens(tokens_BxT)
    x = self.fc(jnp.concatenate([embed, features_BxTxH.astype(embed.dtype)], axis=-1))
    cos, sin = rope_tables(self.config, positions_BxT, x.dtype)
    x, k, v = self.layer(x, cos, sin, 0, cache.k, cache.v, cache.lengths, mask_BxTxW, kv_block, attention,
                         pages=cache.pages)
    return x, dataclasses.replace(cache, k=k, v=v)

  def empty_cache(self, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
    return KVCache.zeros(self.config, batch, capacity, dtype, num_layers=1)
