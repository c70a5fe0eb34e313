"""Parity of the three forward modes with `transformers` for every family, in float32."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tests.conftest import VOCAB, jit_decode, jit_prefill, jit_verify
from tlt_jax.models import KVCache, ModelConfig, hf
from tlt_jax.kernels import layout
from tlt_jax.models import transformer
from tlt_jax.rollout import speculative

TOL = 1e-4


@pytest.fixture(scope="module")
def loaded(hf_dirs):
  cache = {}

  def get(family):
    if family not in cache:
      path, ref = hf_dirs[family]
      model = hf.from_pretrained(path, dtype="float32")
      cache[family] = (*nnx.split(model), ref, model.config)
    return cache[family]

  return get


def ref_logits(ref, ids):
  with torch.no_grad():
    return ref(torch.tensor([ids])).logits[0].numpy()


def ragged_batch(rng, lengths, width):
  """Right-padded rows whose padding is random junk, so that leaking padding would show."""
  return rng.randint(2, VOCAB, (len(lengths), width)), np.asarray(lengths, np.int32)


def test_prefill_ragged_batch(family, loaded):
  graphdef, state, ref, cfg = loaded(family)
  tokens, lengths = ragged_batch(np.random.RandomState(1), [9, 4, 6, 1], 9)
  out = jit_prefill(graphdef, state, tokens, lengths, KVCache.zeros(cfg, 4, 16),
                    all_logits=True)
  for b, n in enumerate(lengths):
    np.testing.assert_allclose(out.logits[b, :n], ref_logits(ref, tokens[b, :n].tolist()), atol=TOL, rtol=0)
  np.testing.assert_array_equal(out.cache.lengths, lengths)
  last = jit_prefill(graphdef, state, tokens, lengths, KVCache.zeros(cfg, 4, 16))
  np.testing.assert_allclose(last.logits, out.logits[np.arange(4), lengths - 1], atol=1e-6, rtol=0)


def test_hidden_states_match_reference(family, loaded):
  graphdef, state, ref, cfg = loaded(family)
  ids = np.random.RandomState(2).randint(2, VOCAB, (1, 8))
  model = nnx.merge(graphdef, state)
  cache = KVCache.zeros(model.config, 1, 8)
  out = transformer.prefill(model, jnp.asarray(ids), jnp.asarray([8]), cache, hidden_layers=(0,))
  with torch.no_grad():
    hs = ref(torch.tensor(ids), output_hidden_states=True).hidden_states
  np.testing.assert_allclose(out.aux_hidden[0][0], hs[1][0].numpy(), atol=TOL, rtol=0)
  np.testing.assert_allclose(out.hidden[0], hs[-1][0].numpy(), atol=TOL, rtol=0)


def test_step_by_step_decode(family, loaded):
  graphdef, state, ref, cfg = loaded(family)
  rng = np.random.RandomState(3)
  prompt_lengths, steps = [5, 2, 7], 6
  seqs = rng.randint(2, VOCAB, (3, 7 + steps))
  out = jit_prefill(graphdef, state, seqs[:, :7], np.asarray(prompt_lengths, np.int32), KVCache.zeros(cfg, 3, 16))
  refs = [ref_logits(ref, seqs[b, :n + steps].tolist()) for b, n in enumerate(prompt_lengths)]
  for i in range(steps + 1):
    for b, n in enumerate(prompt_lengths):
      np.testing.assert_allclose(out.logits[b], refs[b][n - 1 + i], atol=TOL, rtol=0, err_msg=f"step {i} row {b}")
    if i < steps:
      next_tokens = np.asarray([seqs[b, n + i] for b, n in enumerate(prompt_lengths)])
      out = jit_decode(graphdef, state, next_tokens, out.cache)
  np.testing.assert_array_equal(out.cache.lengths, np.asarray(prompt_lengths) + steps)


# A small draft tree: node 0 is the root (the last emitted token); parents index earlier nodes.
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def tree_arrays(parents):
  v = len(parents)
  mask = np.eye(v, dtype=bool)
  depth = np.zeros(v, np.int32)
  for i, p in enumerate(parents):
    if p >= 0:
      mask[i] |= mask[p]
      depth[i] = depth[p] + 1
  return mask, depth


def test_verify_tree(family, loaded):
  graphdef, state, ref, cfg = loaded(family)
  rng = np.random.RandomState(4)
  prompts, lengths = ragged_batch(rng, [6, 3], 6)
  cache = jit_prefill(graphdef, state, prompts, lengths, KVCache.zeros(cfg, 2, 16)).cache
  mask, depth = tree_arrays(PARENTS)
  tree = rng.randint(2, VOCAB, (2, len(PARENTS)))
  positions = lengths[:, None] + depth[None, :]
  out = jit_verify(graphdef, state, tree, positions, np.broadcast_to(mask, (2, *mask.shape)), cache)
  np.testing.assert_array_equal(out.cache.lengths, lengths)  # verify does not commit
  for b, n in enumerate(lengths):
    np.testing.assert_array_equal(out.cache.k[:, b, :n], cache.k[:, b, :n])  # prefix untouched
    for node in range(len(PARENTS)):
      path = np.flatnonzero(mask[node])  # ancestors in order: parents precede children
      expected = ref_logits(ref, prompts[b, :n].tolist() + tree[b, path].tolist())[-1]
      np.testing.assert_allclose(out.logits[b, node], expected, atol=TOL, rtol=0, err_msg=f"row {b} node {node}")


@pytest.mark.parametrize("block", [4, 16])
def test_blockwise_attention_matches_dense(loaded, block):
  graphdef, state, _, cfg = loaded("qwen3")
  model = nnx.merge(graphdef, state)
  tokens, lengths = ragged_batch(np.random.RandomState(5), [5, 3, 0], 5)
  mask, depth = tree_arrays(PARENTS)
  tree = np.random.RandomState(6).randint(2, VOCAB, (3, len(PARENTS)))
  outs = []
  for kv_block in (None, block):
    pre = transformer.prefill(model, jnp.asarray(tokens), jnp.asarray(lengths), KVCache.zeros(cfg, 3, 64),
                              kv_block=kv_block)
    dec = transformer.decode(model, jnp.asarray([7, 9, 11]), pre.cache, kv_block=kv_block)
    ver = transformer.verify(model, jnp.asarray(tree), dec.cache.lengths[:, None] + depth,
                             jnp.broadcast_to(mask, (3, *mask.shape)), dec.cache, kv_block=kv_block)
    outs.append((pre.logits, dec.logits, ver.logits))
  for dense, blocked in zip(*outs):
    np.testing.assert_allclose(blocked, dense, atol=1e-5, rtol=0)


def test_scanned_and_unrolled_layers_build_the_same_parameters():
  cfg = ModelConfig("Qwen3ForCausalLM", VOCAB, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=16, qk_norm=True)
  scanned = transformer.CausalLM(cfg, rngs=nnx.Rngs(0))
  unrolled = transformer.CausalLM(dataclasses.replace(cfg, scan_layers=False), rngs=nnx.Rngs(0))
  stacked = nnx.to_flat_state(nnx.state(scanned.model.layers, nnx.Param))
  for i, layer in enumerate(unrolled.model.layers):
    for (path, s), (path_u, u) in zip(stacked, nnx.to_flat_state(nnx.state(layer, nnx.Param)), strict=True):
      assert path == path_u
      np.testing.assert_array_equal(s.get_value()[i], u.get_value())
  names = scanned.model.layers.mlp.up_proj.kernel.get_metadata()["out_sharding"]
  assert names == ("layers", "embed", "mlp")
  np.testing.assert_array_equal(scanned.model.embed_tokens.embedding, unrolled.model.embed_tokens.embedding)


@pytest.mark.parametrize("kv_block", [None, 4])
def test_scanned_and_unrolled_layers_agree(hf_dirs, kv_block):
  """Same logits (float tolerance), hidden states of chosen layers, caches and greedy tokens."""
  path, _ = hf_dirs["qwen2_untied"]
  models = [hf.from_pretrained(path, scan_layers=scan) for scan in (True, False)]
  assert [m.config.scan_layers for m in models] == [True, False]
  tokens, lengths = ragged_batch(np.random.RandomState(7), [5, 3, 1], 5)
  mask, depth = tree_arrays(PARENTS)
  tree = np.random.RandomState(8).randint(2, VOCAB, (3, len(PARENTS)))

  @functools.partial(jax.jit, static_argnums=0)
  def run(graphdef, state):
    model = nnx.merge(graphdef, state)
    pre = transformer.prefill(model, tokens, lengths, KVCache.zeros(model.config, 3, 32), all_logits=True,
                              kv_block=kv_block, hidden_layers=(0, 1))
    dec = transformer.decode(model, jnp.argmax(pre.logits[jnp.arange(3), lengths - 1], -1), pre.cache,
                             kv_block=kv_block, hidden_layers=(1,))
    ver = transformer.verify(model, tree, dec.cache.lengths[:, None] + depth, jnp.broadcast_to(mask, (3, *mask.shape)),
                             dec.cache, kv_block=kv_block, hidden_layers=(0,))
    return pre, dec, ver

  scanned, unrolled = (run(*nnx.split(m)) for m in models)
  for got, want in zip(jax.tree.leaves(scanned), jax.tree.leaves(unrolled), strict=True):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  for got, want in zip(scanned, unrolled):
    np.testing.assert_array_equal(np.argmax(got.logits, -1), np.argmax(want.logits, -1))


def test_scanned_and_unrolled_layers_agree_under_remat(hf_dirs):
  """Training's forward (remat, query blocks) and its gradient are the same in both forms."""
  path, _ = hf_dirs["qwen3"]
  tokens = jnp.asarray(np.random.RandomState(9).randint(2, VOCAB, (2, 8)))
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((8, 8), bool)), (2, 8, 8))

  def loss(state, graphdef):
    model = nnx.merge(graphdef, state)
    hidden, aux, _ = model(tokens, jnp.broadcast_to(jnp.arange(8), (2, 8)), KVCache.zeros(model.config, 2, 8), causal,
                           remat=True, query_block=4, hidden_layers=(0,))
    return jnp.sum(model.logits(hidden) ** 2) + jnp.sum(aux[0])

  grads = []
  for scan in (True, False):
    graphdef, state = nnx.split(hf.from_pretrained(path, scan_layers=scan))
    value, grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)(state, graphdef)
    grads.append((value, grad))
  (v_scan, g_scan), (v_unrolled, g_unrolled) = grads
  np.testing.assert_allclose(v_scan, v_unrolled, rtol=1e-6)
  for i in range(2):
    for (path_, a), (_, b) in zip(nnx.to_flat_state(g_scan.model.layers), nnx.to_flat_state(g_unrolled.model.layers[i]),
                                  strict=True):
      np.testing.assert_allclose(a.get_value()[i], b.get_value(), atol=1e-5, rtol=1e-4, err_msg=str(path_))


@pytest.mark.parametrize("scan,dtype", [(True, "float32"), (False, "float32"), (False, "bfloat16")])
def test_remat_keeps_one_layers_activations_and_the_gradient(hf_dirs, scan, dtype):
  """The gradient of a training forward needs far less scratch memory under remat, scanned and unrolled
  (unrolled, XLA:CPU merged `jax.checkpoint`'s recomputation back into the forward pass: no saving), and is
  the gradient without remat, in float32 and in the GPU configs' bfloat16 compute over float32 masters."""
  path, _ = hf_dirs["qwen3"]
  graphdef, state = nnx.split(hf.from_pretrained(path, dtype=dtype, param_dtype="float32", scan_layers=scan))
  tokens = jnp.asarray(np.random.RandomState(3).randint(2, VOCAB, (4, 64)))
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((64, 64), bool)), (4, 64, 64))

  def grad(remat):
    def loss(state):
      hidden, _, _ = nnx.merge(graphdef, state)(tokens, jnp.broadcast_to(jnp.arange(64), (4, 64)), None, causal,
                                                remat=remat)
      return jnp.sum(hidden.astype(jnp.float32) ** 2)
    lowered = jax.jit(jax.grad(loss)).lower(state)
    return lowered.compile().memory_analysis().temp_size_in_bytes, jax.jit(jax.grad(loss))(state)

  (with_remat, g_remat), (without, g_plain) = grad(True), grad(False)
  # In bfloat16 compute the float32 weight gradients weigh more of what is left.
  assert with_remat < (0.6 if dtype == "float32" else 0.7) * without
  for (name, a), (_, b) in zip(nnx.to_flat_state(g_remat), nnx.to_flat_state(g_plain), strict=True):
    a, b = np.asarray(a.get_value(), np.float32), np.asarray(b.get_value(), np.float32)
    np.testing.assert_allclose(a, b, atol=1e-5 if dtype == "float32" else 2e-2 * np.abs(b).max(), rtol=1e-4,
                               err_msg=str(name))


@pytest.mark.parametrize("kv_block", [None, 4])
def test_a_paged_cache_decodes_as_a_contiguous_one(loaded, kv_block):
  """Prefill, decode, verify and commit with rows scattered over a shuffled pool of 4-slot pages
  (two rows sharing their first page, as samples of one prompt do) give the contiguous cache's
  logits and cache contents."""
  graphdef, state, _, cfg = loaded("qwen3")
  model = nnx.merge(graphdef, state)
  rng = np.random.RandomState(7)
  tokens = rng.randint(2, VOCAB, (3, 6))
  tokens[1, :4] = tokens[0, :4]  # rows 0 and 1 share a full first page
  lengths = np.asarray([6, 5, 3], np.int32)
  table = np.asarray([[9, 2, 5, 11], [9, 7, 0, 3], [4, 10, 1, 8]], np.int32)
  caches = {"contiguous": KVCache.zeros(cfg, 3, 16), "paged": KVCache.paged(cfg, table, 13, 4)}
  mask, depth = tree_arrays(PARENTS)
  tree = rng.randint(2, VOCAB, (3, len(PARENTS)))
  outs = {}
  for name, cache in caches.items():
    pre = transformer.prefill(model, jnp.asarray(tokens), jnp.asarray(lengths), cache, kv_block=kv_block)
    dec = transformer.decode(model, jnp.asarray([7, 9, 11]), pre.cache, kv_block=kv_block)
    ver = transformer.verify(model, jnp.asarray(tree), dec.cache.lengths[:, None] + depth,
                             jnp.broadcast_to(mask, (3, *mask.shape)), dec.cache, kv_block=kv_block)
    committed = speculative.commit(ver.cache, jnp.asarray([[0, 1, 3], [0, 2, 5], [0, 1, 3]]), jnp.asarray([3, 1, 2]))
    again = transformer.decode(model, jnp.asarray([5, 6, 7]), committed, kv_block=kv_block)
    rows = layout.rows(again.cache.k, 0, again.cache.pages)
    outs[name] = (pre.logits, dec.logits, ver.logits, again.logits, rows[:, :12])
  for name, contiguous, paged in zip(("prefill", "decode", "verify", "after commit", "cache"), outs["contiguous"],
                                     outs["paged"]):
    np.testing.assert_allclose(paged, contiguous, atol=1e-5, rtol=0, err_msg=name)
