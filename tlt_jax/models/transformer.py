"""The target decoder (Qwen2/2.5, R1-Distill-Qwen, Llama 3.x, Qwen3) over an explicit KV cache.

One forward pass serves all three modes. After a row's prefix (slots `< lengths[b]`) comes a
window of W slots whose last T receive the new tokens' keys/values (the first W - T hold tree
tokens of earlier calls: the drafter's previous tree levels). New tokens attend to
  * the whole prefix, and
  * the window slots selected by `mask_BxTxW` (causal for prefill, the ancestor mask of a draft
    tree for speculative verification, a single 1 for decode; W = T except for the drafter).
`prefill` and `decode` then advance `lengths`; `verify` does not (the caller commits the accepted
path). With `kv_block` set, attention walks the cache in blocks only up to the longest row's
filled length (`tlt_jax.kernels.tree_attention`), so its cost tracks the filled length rather than the
cache capacity, by the implementation `attention` names ("auto": the backend's Pallas kernel, the
jnp reference on CPU); `kv_block=None` is one dense, differentiable softmax (training).

The decoder layers run in one of two forms (`ModelConfig.scan_layers`), through one layer body:
scanned (the default), their parameters stacked along a leading layer axis and one `lax.scan`
over them, so an executable compiles the body once whatever the depth; or unrolled, each layer
its own parameters and its own copy of the body in the executable. Scanned, the KV cache's layer
axis is carried through the scan whole: layer i writes and reads its slice at a traced index
(the attention kernels take it at run time), and the requested layers' outputs (`hidden_layers`)
are carried too, each kept when its layer comes by.

Module and parameter names mirror Hugging Face's (`model.layers.3.self_attn.q_proj`; stacked:
`model.layers.self_attn.q_proj` [L, ...]), which keeps the checkpoint mapping in `hf.py` mechanical.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from tlt_jax.kernels import layout, tree_attention
from tlt_jax import sharding
from tlt_jax.models.config import ModelConfig

_init = nnx.initializers.normal(0.02)


def _partitioned(init, names):
  # Logical names only; `sharding.param_shardings` resolves them against a mesh when one is used.
  return nnx.with_partitioning(init, names, eager_sharding=False)


class Linear(nnx.Linear):
  """`nnx.Linear`, plus a LoRA adapter where `tlt_jax.models.lora` attached one: x W + b + scale (x A) B."""

  lora: nnx.LoRA | None = None  # set per instance by `lora.attach`; absent, the module is nnx.Linear's
  lora_scale: float = 0.0

  def __call__(self, x):
    y = super().__call__(x)
    return y if self.lora is None else y + self.lora(x) * jnp.asarray(self.lora_scale, y.dtype)


def linear(n_in, n_out, names, bias, dtype, rngs, param_dtype=None):
  """A Linear layer with the package's initialisation and logical axis `names` (the drafter's too)."""
  return Linear(
      n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=param_dtype or dtype, rngs=rngs,
      kernel_init=_partitioned(_init, names),
      bias_init=_partitioned(nnx.initializers.zeros, names[1:]))


def _norm(size, eps, dtype, rngs, name="norm", param_dtype=None):
  return nnx.RMSNorm(size, epsilon=eps, dtype=dtype, param_dtype=param_dtype or dtype, rngs=rngs,
                     scale_init=_partitioned(nnx.initializers.ones, (name,)))


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values with static shapes, and each row's filled length.

  Contiguous (`pages` None), row b owns k[:, b] whole: N = B, P = its capacity. Paged, the rows
  share a pool of N pages of P slots and row b's slot s is in page `pages[b, s // P]`
  (`tlt_jax.kernels.layout`): rows hold pages as they grow and several rows may hold the same
  (a prompt's), so the rows in flight are bounded by the tokens they hold, not their capacity.
  """

  k: jax.Array  # [L, N, P, Hkv, D]
  v: jax.Array  # [L, N, P, Hkv, D]
  lengths: jax.Array  # [B] int32: slots [0, lengths[b]) hold row b's prefix
  pages: jax.Array | None = None  # [B, M] int32 page table; N: no page (writes dropped); None: contiguous

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.float32,
            num_layers: int | None = None) -> "KVCache":
    """A contiguous cache of `capacity` slots per row."""
    shape = (cfg.num_layers if num_layers is None else num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

  @classmethod
  def paged(cls, cfg: ModelConfig, pages_BxM, num_pages: int, page_size: int, dtype=jnp.float32,
            num_layers: int | None = None) -> "KVCache":
    """A pool of `num_pages` pages of `page_size` slots, rows holding the pages of `pages_BxM`."""
    shape = (cfg.num_layers if num_layers is None else num_layers, num_pages, page_size, cfg.num_kv_heads,
             cfg.head_dim)
    pages_BxM = jnp.asarray(pages_BxM, jnp.int32)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros(pages_BxM.shape[:1], jnp.int32), pages_BxM)

  @property
  def capacity(self) -> int:
    """Slots per row."""
    return layout.capacity(self.k, self.pages)


@flax.struct.dataclass
class Output:
  logits: jax.Array  # [B, V] (prefill/decode) or [B, T, V] (verify, prefill with all_logits)
  hidden: jax.Array  # [B, T, H] last hidden state after the final norm ([B, H] for decode)
  aux_hidden: tuple[jax.Array, ...]  # [B, T, H] outputs of the requested decoder layers
  cache: KVCache


def _rope(x_BxTxNxD, cos_BxTxD, sin_BxTxD):
  """Rotary embedding in the half-split layout Hugging Face uses."""
  half = x_BxTxNxD.shape[-1] // 2
  rotated = jnp.concatenate([-x_BxTxNxD[..., half:], x_BxTxNxD[..., :half]], axis=-1)
  cos, sin = cos_BxTxD[:, :, None, :], sin_BxTxD[:, :, None, :]
  return (x_BxTxNxD * cos + rotated * sin).astype(x_BxTxNxD.dtype)


def _write(cache_LxNxPxKxD, layer, new_BxTxKxD, start_B, pages_BxM):
  """Writes layer `layer`'s new entries of each row from the row's own offset `start_B` (through
  its page table when paged; slots past the row's capacity or pages are dropped).

  Only the new entries move: the (possibly 32k-slot) cache is updated in place, never copied.
  """
  t = new_BxTxKxD.shape[1]
  slots = start_B[:, None] + jnp.arange(t)[None, :]
  page, offset = layout.address(pages_BxM, slots, cache_LxNxPxKxD.shape[2], cache_LxNxPxKxD.shape[1])
  return cache_LxNxPxKxD.at[layer, page, offset].set(new_BxTxKxD.astype(cache_LxNxPxKxD.dtype), mode="drop")


def _by_query_blocks(attend, q_BxTxHxD, mask_BxTxW, size):
  """`attend` over `size` queries at a time, recomputed in the backward pass: training a long row
  never holds more than [size, cache] attention scores (a dense 32k x 32k would not fit)."""
  b, t, h, d = q_BxTxHxD.shape
  if t % size:
    raise ValueError(f"{t} query tokens are not a multiple of the query block {size}")
  split = lambda x: jnp.moveaxis(x.reshape(b, t // size, size, *x.shape[2:]), 1, 0)
  out = jax.lax.map(jax.checkpoint(lambda args: attend(*args)), (split(q_BxTxHxD), split(mask_BxTxW)))
  return jnp.moveaxis(out, 0, 1).reshape(b, t, h, d)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, param_dtype=None):
    self.cfg = cfg
    h, d = cfg.hidden_size, cfg.head_dim
    proj = lambda n_in, n_out, names, bias: linear(n_in, n_out, names, bias, dtype, rngs, param_dtype)
    self.q_proj = proj(h, cfg.num_heads * d, ("embed", "q_heads"), cfg.qkv_bias)
    self.k_proj = proj(h, cfg.num_kv_heads * d, ("embed", "kv_heads"), cfg.qkv_bias)
    self.v_proj = proj(h, cfg.num_kv_heads * d, ("embed", "kv_heads"), cfg.qkv_bias)
    self.o_proj = proj(cfg.num_heads * d, h, ("q_heads", "embed"), False)
    if cfg.qk_norm:
      self.q_norm = _norm(d, cfg.rms_norm_eps, dtype, rngs, "head_dim", param_dtype)
      self.k_norm = _norm(d, cfg.rms_norm_eps, dtype, rngs, "head_dim", param_dtype)

  def __call__(self, x_BxTxH, cos, sin, layer, k_LxNxPxKxD, v_LxNxPxKxD, lengths_B, mask_BxTxW, kv_block, attention,
               query_block=None, pages_BxM=None):
    cfg = self.cfg
    b, t, _ = x_BxTxH.shape
    q = self.q_proj(x_BxTxH).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = self.k_proj(x_BxTxH).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = self.v_proj(x_BxTxH).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    if k_LxNxPxKxD is None:  # training: self-attention over the tokens' own keys, no cache
      attend = lambda q_, mask_: tree_attention.dense(q_, k, v, mask_)
      out = attend(q, mask_BxTxW) if query_block is None else _by_query_blocks(attend, q, mask_BxTxW, query_block)
      return self.o_proj(out.reshape(b, t, cfg.num_heads * cfg.head_dim)), None, None
    start = lengths_B + mask_BxTxW.shape[2] - t
    k_LxNxPxKxD = sharding.constrain(_write(k_LxNxPxKxD, layer, k, start, pages_BxM), (None, *sharding.CACHE_AXES))
    v_LxNxPxKxD = sharding.constrain(_write(v_LxNxPxKxD, layer, v, start, pages_BxM), (None, *sharding.CACHE_AXES))
    attend = lambda q_, mask_: tree_attention.attention(q_, k_LxNxPxKxD, v_LxNxPxKxD, layer, lengths_B, mask_,
                                                         impl=attention, block=kv_block, pages_BxM=pages_BxM)
    out = attend(q, mask_BxTxW) if query_block is None else _by_query_blocks(attend, q, mask_BxTxW, query_block)
    return self.o_proj(out.reshape(b, t, cfg.num_heads * cfg.head_dim)), k_LxNxPxKxD, v_LxNxPxKxD


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, param_dtype=None):
    h, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
    self.gate_proj = linear(h, f, ("embed", "mlp"), bias, dtype, rngs, param_dtype)
    self.up_proj = linear(h, f, ("embed", "mlp"), bias, dtype, rngs, param_dtype)
    self.down_proj = linear(f, h, ("mlp", "embed"), bias, dtype, rngs, param_dtype)

  def __call__(self, x):
    return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_tables(cfg: ModelConfig, positions_BxT, dtype):
  """cos, sin [B, T, head_dim] for the given positions."""
  angles = positions_BxT[..., None].astype(jnp.float32) * jnp.asarray(cfg.inv_freq(), jnp.float32)
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


class DecoderLayer(nnx.Module):
  """Pre-norm attention + SwiGLU MLP. The EAGLE drafter's layer has no input norm."""

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, input_norm: bool = True, param_dtype=None):
    norm = lambda: _norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs, param_dtype=param_dtype)
    self.input_layernorm = norm() if input_norm else None
    self.self_attn = Attention(cfg, dtype, rngs, param_dtype)
    self.post_attention_layernorm = norm()
    self.mlp = MLP(cfg, dtype, rngs, param_dtype)

  def __call__(self, x, cos, sin, layer, k, v, lengths, mask, kv_block, attention, query_block=None, pages=None):
    h = x if self.input_layernorm is None else self.input_layernorm(x)
    attn, k, v = self.self_attn(h, cos, sin, layer, k, v, lengths, mask, kv_block, attention, query_block, pages)
    x = x + attn
    x = x + self.mlp(self.post_attention_layernorm(x))
    return sharding.constrain(x, sharding.ACTIVATION_AXES), k, v


def _stack(layers: Sequence[DecoderLayer]) -> DecoderLayer:
  """One layer whose parameters hold those of `layers` along a leading, unsharded `layers` axis.

  The layers are built one by one first, so a stacked model's parameters are, layer for layer,
  the unrolled model's of the same seed.
  """
  def stack(*vs):
    names = vs[0].get_metadata().get("out_sharding") or (None,) * vs[0].ndim
    return vs[0].replace(jnp.stack([v.get_value() for v in vs]), out_sharding=("layers", *names))

  state = jax.tree.map(stack, *(nnx.state(layer) for layer in layers), is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(nnx.graphdef(layers[0]), state)


class Decoder(nnx.Module):

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, param_dtype=None):
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype or dtype,
                                  embedding_init=_partitioned(_init, ("vocab", "embed")),
                                  rngs=rngs)
    layers = [DecoderLayer(cfg, dtype, rngs, param_dtype=param_dtype) for _ in range(cfg.num_layers)]
    self.layers = _stack(layers) if cfg.scan_layers else nnx.List(layers)
    self.norm = _norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs, param_dtype=param_dtype)


class CausalLM(nnx.Module):
  """Decoder + LM head. Call it through `prefill`, `decode` or `verify`.

  `dtype` is the compute dtype (matmul inputs, activations, KV caches); `param_dtype` (default: the
  same) the weights' own. Mixed precision as MaxText keeps it: float32 weights (an optimizer's masters)
  cast to a bfloat16 `dtype` as each layer reads them, normalization statistics and the LM head's
  accumulation in float32.
  """

  def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=None, rngs: nnx.Rngs):
    self.config = cfg
    self.dtype = jnp.dtype(dtype)
    self.model = Decoder(cfg, dtype, rngs, param_dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), False, dtype, rngs, param_dtype)

  def logits(self, hidden):
    """LM head over final hidden states: float32 logits, the matmul's inputs in the compute dtype and its
    sums in float32 (bfloat16 logits of ~20 would be 0.125 apart)."""
    if self.config.tie_word_embeddings:
      w = self.model.embed_tokens.embedding.get_value()
      return jnp.einsum("...h,vh->...v", hidden.astype(self.dtype), w.astype(self.dtype),
                        preferred_element_type=jnp.float32)
    w = self.lm_head.kernel.get_value()
    return jnp.einsum("...h,hv->...v", hidden.astype(self.dtype), w.astype(self.dtype),
                      preferred_element_type=jnp.float32)

  def __call__(self, tokens_BxT, positions_BxT, cache: KVCache | None, mask_BxTxW, *,
               kv_block: int | None = None, attention: str = "auto", hidden_layers: Sequence[int] = (),
               remat: bool = False, query_block: int | None = None):
    """Runs T new tokens per row; returns (final hidden [B,T,H], aux hidden, cache with them written).

    `hidden_layers` are 0-based decoder-layer indices whose outputs are returned (EAGLE-3 input;
    layer i is Hugging Face's `hidden_states[i + 1]`). For training long sequences, `remat`
    recomputes each layer in the backward pass instead of keeping its activations, and
    `query_block` computes attention that many queries at a time. `cache=None` (training): the T tokens
    attend to one another only (`mask_BxTxW` is [B, T, T]), nothing is cached, and None is returned for it.
    """
    cfg = self.config
    x = sharding.constrain(self.model.embed_tokens(tokens_BxT), sharding.ACTIVATION_AXES)
    cos, sin = rope_tables(cfg, positions_BxT, x.dtype)
    if cfg.scan_layers:
      layer_def, stacked = nnx.split(self.model.layers)
    else:
      layer_def = nnx.graphdef(self.model.layers[0])

    def run(state, x, k, v, i):
      return nnx.merge(layer_def, state)(x, cos, sin, i, k, v, lengths, mask_BxTxW, kv_block, attention,
                                         query_block, pages)

    if remat:  # unrolled, the layer index stays a Python int: each copy indexes the cache at a constant
      run = jax.checkpoint(run) if cfg.scan_layers else _remat_in_order(run)

    def step(carry, layer):
      """Layer i over the carry (x, caches, requested outputs); the body of both forms."""
      (x, k, v, aux), (i, state) = carry, layer
      x, k, v = run(state, x, k, v, i)
      return (x, k, v, tuple(jnp.where(i == j, x, a) for j, a in zip(hidden_layers, aux))), None

    lengths, pages, k, v = (None,) * 4 if cache is None else (cache.lengths, cache.pages, cache.k, cache.v)
    carry = (x, k, v, tuple(jnp.zeros_like(x) for _ in hidden_layers))
    if cfg.scan_layers:  # the cache's layer axis is carried whole: layer i writes and reads its own slice
      carry, _ = jax.lax.scan(step, carry, (jnp.arange(cfg.num_layers), stacked))
    else:
      for i, layer in enumerate(self.model.layers):
        carry, _ = step(carry, (i, nnx.state(layer)))
    x, k, v, aux = carry
    return self.model.norm(x), aux, None if cache is None else dataclasses.replace(cache, k=k, v=v)


def _remat_in_order(run):
  """`run(state, x, k, v, i)` (i a Python int) recomputed in the backward pass, each layer's recomputation
  once the gradient of its output exists. `jax.checkpoint` over unrolled layers keeps its recomputation
  apart from the forward pass with optimization barriers, which XLA:CPU removes before its common-subexpression
  pass: the recomputation then merges back into the forward pass and every layer's activations stay alive
  (SmolLM2's gradient needed as much with remat as without). Here the recomputation's input depends on the
  output's cotangent (x + 0 * one element of it: the same value, which no compiler folds for floats), so it
  can neither merge with the forward pass nor start before its layer's turn in the backward pass."""

  def layer(i):
    @jax.custom_vjp
    def f(state, x, k, v):
      return run(state, x, k, v, i)

    def fwd(state, x, k, v):
      return f(state, x, k, v), (state, x, k, v)

    def bwd(saved, cotangent):
      state, x, k, v = saved
      x = x + jnp.zeros((), x.dtype) * cotangent[0].reshape(-1)[0].astype(x.dtype)
      return jax.vjp(lambda *a: run(*a, i), state, x, k, v)[1](cotangent)

    f.defvjp(fwd, bwd)
    return f

  return lambda state, x, k, v, i: layer(i)(state, x, k, v)


def prefill(model: CausalLM, tokens_BxT, lengths_B, cache: KVCache, *, all_logits: bool = False,
            kv_block: int | None = None, attention: str = "auto", hidden_layers: Sequence[int] = ()) -> Output:
  """Prefill of a right-padded ragged batch (rows of `lengths_B` tokens) after each row's prefix.

  Args:
    model: the target.
    tokens_BxT: int32 tokens, row b's first `lengths_B[b]` real, the rest padding.
    lengths_B: real tokens per row (0: the row is untouched).
    cache: the rows' caches; row b's tokens go to slots `cache.lengths[b] ..` (its prefix, if any,
      is attended to).
    all_logits: logits of every position instead of each row's last real token.
    kv_block, attention: the attention block and implementation (`tlt_jax.kernels.tree_attention`).
    hidden_layers: also return these layers' hidden states (EAGLE-3 features).

  Returns:
    `Output`: float32 logits [B, vocab] of each row's last real token ([B, T, vocab] with
    `all_logits`), final hidden states [B, T, H], the requested layers' hidden states, and the
    cache with the tokens written and its lengths advanced by `lengths_B`.
  """
  b, t = tokens_BxT.shape
  positions = cache.lengths[:, None] + jnp.arange(t)[None, :]
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  hidden, aux, cache = model(tokens_BxT, positions, cache, causal, kv_block=kv_block, attention=attention,
                             hidden_layers=hidden_layers)
  if all_logits:
    logits = model.logits(hidden)
  else:
    last = jnp.take_along_axis(hidden, jnp.maximum(lengths_B - 1, 0)[:, None, None], axis=1)[:, 0]
    logits = model.logits(last)
  cache = dataclasses.replace(cache, lengths=cache.lengths + lengths_B.astype(jnp.int32))
  return Output(logits, hidden, aux, cache)


def decode(model: CausalLM, tokens_B, cache: KVCache, *, kv_block: int | None = None, attention: str = "auto",
           hidden_layers: Sequence[int] = ()) -> Output:
  """One token per row (`tokens_B`) at position `cache.lengths`.

  Returns:
    `Output`: float32 logits [B, vocab], final hidden states [B, H], the requested layers' hidden
    states [B, H] each, and the cache with the token written and its lengths advanced by one.
  """
  b = tokens_B.shape[0]
  hidden, aux, cache = model(tokens_B[:, None], cache.lengths[:, None], cache, jnp.ones((b, 1, 1), bool),
                             kv_block=kv_block, attention=attention, hidden_layers=hidden_layers)
  cache = dataclasses.replace(cache, lengths=cache.lengths + 1)
  return Output(model.logits(hidden[:, 0]), hidden[:, 0], tuple(a[:, 0] for a in aux), cache)


def verify(model: CausalLM, tokens_BxV, positions_BxV, mask_BxVxV, cache: KVCache, *,
           kv_block: int | None = None, attention: str = "auto", hidden_layers: Sequence[int] = ()) -> Output:
  """Speculative verification: V tree tokens per row with explicit positions and ancestor mask.

  Args:
    tokens_BxV: the tree's tokens (node 0: the row's last committed token).
    positions_BxV: each node's position (`cache.lengths` + its depth).
    mask_BxVxV: `mask[b, i, j]`: node i attends to node j (j is i or one of its ancestors).
    cache: the rows' caches; every node also attends to the whole filled prefix.

  Returns:
    `Output`: float32 logits [B, V, vocab] (node i's: the distribution after its path), final
    hidden states [B, V, H], the requested layers' hidden states, and the cache with the tree's
    keys/values written at slots `lengths .. lengths + V - 1` but its lengths not advanced:
    committing the accepted path is the caller's job (`KVCache` slots past the length are free).
  """
  hidden, aux, cache = model(tokens_BxV, positions_BxV, cache, mask_BxVxV, kv_block=kv_block, attention=attention,
                             hidden_layers=hidden_layers)
  return Output(model.logits(hidden), hidden, aux, cache)
