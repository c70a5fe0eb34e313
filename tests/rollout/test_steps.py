"""The step functions on their own: the prefill's and the plain segment's drafter feeds equal
feeding it pair by pair; a reset and a halving move rows and nothing else (a halving without a scratch copy
of the caches); a preempted row resumes as it was."""

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.rollout.conftest import CONFIG, STOP, configured, prompts, with_sd
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import transformer
from tlt_jax.models.transformer import KVCache
from tlt_jax.rollout import speculative, steps as steps_lib
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.speculative import Strategy
from tlt_jax.rollout.state import SlotRows


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def padded(ps, t=24):
  """The prompts `ps` right-padded to t tokens, and their lengths."""
  tokens = np.zeros((len(ps), t), np.int32)
  for i, p in enumerate(ps):
    tokens[i, :len(p)] = p
  return tokens, np.asarray([len(p) for p in ps], np.int32)


def slot_rows(row_id, max_new):
  """Slot b holds row `row_id[b]`, of prompt `row_id[b]`, sample 0, with no bank."""
  zeros = row_id * 0
  return SlotRows(prompt_index=row_id, sample_index=zeros, row_id=row_id, max_new=max_new, bank_row=zeros,
                  bank_offset=zeros, bank_room=zeros)


def test_prefill_feeds_the_drafter_each_rows_prompt_pairs(models):
  """The prefill runs the drafter once per unique prompt and copies it into the prompt's rows, then
  feeds each row its own last pair; the result equals one drafter pass over the row's whole prompt."""
  model = models["qwen3"]
  drafter = Drafter(model.config, rngs=nnx.Rngs(5))
  engine = Engine(model, with_sd(CONFIG, "2_2_4"), SamplingParams(temperature=1.0, max_new_tokens=64, seed=4,
                                                                   stop_token_ids=(STOP,)), drafter=drafter)
  t = 24
  tokens, lengths = padded(prompts(3, seed=31), t)
  row_prompt = np.asarray([0, 0, 1, 2, 2, 2, -1, -1], np.int32)  # 2, 1 and 3 samples; 2 empty rows
  ids = np.arange(8, dtype=np.int32)
  st = jax.jit(engine.steps.init)(slot_rows(ids, np.full((8,), 64, np.int32)))
  st = jax.jit(engine.steps.prefill)(engine.params, engine.drafter_params, st, tokens, lengths, row_prompt,
                                     np.zeros((3, 0), np.int32), np.zeros((8,), np.int32))

  out = transformer.prefill(model, tokens, lengths, KVCache.zeros(model.config, 3, t))
  src = np.maximum(row_prompt, 0)
  pairs = np.concatenate([tokens[:, 1:], np.zeros((3, 1), np.int32)], axis=1)[src]
  pairs[np.arange(8), lengths[src] - 1] = np.asarray(st.tokens)[:, 0]  # each row's own first token
  ref_out, ref_cache = drafter(model, out.hidden[src], pairs, np.broadcast_to(np.arange(t), (8, t)),
                               drafter.empty_cache(8, t), np.broadcast_to(np.tril(np.ones((t, t), bool)), (8, t, t)))
  for r in range(6):
    n = lengths[src[r]]
    assert int(st.drafter_cache.lengths[r]) == n
    for name in ("k", "v"):
      np.testing.assert_allclose(getattr(st.drafter_cache, name)[:, r, :n], getattr(ref_cache, name)[:, r, :n],
                                 atol=1e-5)
    np.testing.assert_allclose(st.draft_feat[r], ref_out[r, n - 1], atol=1e-5)
  assert not np.asarray(st.drafter_cache.lengths)[6:].any()


def test_plain_segments_keep_the_drafter_cache_current(models):
  """A plain segment feeds the drafter its committed pairs in one chunk at the end; the drafter
  cache and last output equal feeding them step by step (one-node verify steps)."""
  model = models["qwen3"]
  engine = Engine(model, with_sd(CONFIG, "2_2_4"), SamplingParams(temperature=1.0, max_new_tokens=64, seed=3,
                                                                   stop_token_ids=(STOP,)),
                  drafter=Drafter(model.config, rngs=nnx.Rngs(7)))
  tokens, lengths = padded(prompts(4, seed=30))
  ids = np.arange(4, dtype=np.int32)
  budgets = np.asarray([3, 64, 64, 64], np.int32)  # row 0 ends inside the segment
  steps = engine.steps
  st = jax.jit(steps.init)(slot_rows(ids, budgets))
  st = jax.jit(steps.prefill)(engine.params, engine.drafter_params, st, tokens, lengths, ids,
                              np.zeros((4, 0), np.int32), np.zeros((4,), np.int32))
  chunked = jax.jit(functools.partial(steps.segment, strategy=None))(engine.params, engine.drafter_params, st, 0)

  @jax.jit
  def one_step(p, d, s):
    model, drafter = steps.models(p, d)
    verified = steps.verify_step(model, drafter, s, speculative.root_only(s.last_token), 0)
    return steps.feed_drafter(model, drafter, verified.state, verified.pairs, CONFIG.kv_block)

  stepped = st
  for _ in range(CONFIG.segment_steps):
    stepped = one_step(engine.params, engine.drafter_params, stepped)
  np.testing.assert_array_equal(chunked.tokens, stepped.tokens)
  lengths = np.asarray(stepped.drafter_cache.lengths)
  np.testing.assert_array_equal(chunked.drafter_cache.lengths, lengths)
  assert lengths[0] < lengths[1]  # the finished row stopped feeding
  for name in ("k", "v"):
    a, b = (np.asarray(getattr(s.drafter_cache, name)) for s in (chunked, stepped))
    for r, n in enumerate(lengths):
      np.testing.assert_allclose(a[:, r, :n], b[:, r, :n], atol=1e-5)
  np.testing.assert_allclose(chunked.draft_feat, stepped.draft_feat, atol=1e-5)


def filled_state(steps, b, seed):
  """`init`'s state of b slots with every field, caches and bank included, random."""
  rng = np.random.default_rng(seed)
  ids = np.arange(b, dtype=np.int32)
  st = jax.jit(steps.init)(slot_rows(ids, np.full((b,), 8, np.int32)))
  fill = lambda x: (rng.random(x.shape) < 0.5 if x.dtype == bool else rng.integers(0, 50, x.shape)).astype(x.dtype)
  return jax.tree.map(fill, st)


def test_halve_gathers_rows_and_keeps_the_bank(models):
  steps = Engine(models["qwen3"], with_sd(CONFIG, "s2_2_4"), SamplingParams(max_new_tokens=8)).steps
  st = filled_state(steps, 4, seed=0)
  out = jax.jit(steps_lib.halve)(st, np.asarray([2, -1], np.int32))
  a, b = jax.device_get((st, out))
  for name, x in vars(b.per_row()).items():
    if x is not None and name not in ("done", "row_id"):
      np.testing.assert_array_equal(x[0], getattr(a, name)[2], err_msg=name)
  assert b.row_id.tolist() == [a.row_id[2], -1] and b.done.tolist() == [a.done[2], True]
  for name in ("k", "v"):
    np.testing.assert_array_equal(getattr(b.cache, name), getattr(a.cache, name)[:, [2, 0]])
  np.testing.assert_array_equal(b.cache.lengths, a.cache.lengths[[2, 0]])
  np.testing.assert_array_equal(b.bank, a.bank)


def test_the_engine_halves_a_contiguous_cache_one_array_at_a_time(models):
  """`Engine._halve` gives `halve`'s state, the old keys freed before the values are gathered: the peak holds half
  of one array beside the cache, not half of both."""
  engine = Engine(models["qwen3"], CONFIG, SamplingParams(max_new_tokens=8))
  engine.prepare(4)
  st, keep = jax.device_put(filled_state(engine.steps, 4, seed=2)), np.asarray([3, -1], np.int32)
  expected = jax.device_get(jax.jit(steps_lib.halve)(st, keep))
  keys_freed, take = [], engine.pool[("take_rows", 2, 4)]
  engine.pool._executables[("take_rows", 2, 4)] = (  # pylint: disable=protected-access
      lambda x, keep_b: keys_freed.append(st.cache.k.is_deleted()) or take(x, keep_b))
  out = engine._halve(st, keep, 4)  # pylint: disable=protected-access
  assert keys_freed == [True] and st.cache.v.is_deleted()
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(out), expected)


def test_halving_holds_no_copy_of_the_caches():
  """The engine's halving writes the halved caches where it returns them: XLA:CPU's gather over the 5-d caches
  had come out transposed and been copied out, half a cache of scratch (seen at the compiler's default
  optimisation, which this process's fast-compile flags change: a process of its own; 3 heads of 64)."""
  code = """if True:
    import jax.numpy as jnp
    from flax import nnx
    from tlt_jax.models import CausalLM, ModelConfig
    from tlt_jax.rollout.engine import Engine
    from tlt_jax.rollout.sampling import SamplingParams
    from tlt_jax.rollout.state import EngineConfig
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=3, num_kv_heads=3, head_dim=64)
    engine = Engine(CausalLM(cfg, rngs=nnx.Rngs(0)), EngineConfig(batch_buckets=(1, 2, 4, 8), max_prompt_len=64,
                    max_new_tokens=64), SamplingParams(max_new_tokens=64))
    engine.prepare(8)
    half = engine._abstract_state(4).cache.k
    print(engine.pool[("halve", 4, 8)].memory_analysis().temp_size_in_bytes, half.size * half.dtype.itemsize)"""
  env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  temp, half = map(int, out.stdout.split()[-2:])
  assert temp < 0.1 * half, (temp, half)


def test_reset_empties_the_new_rows_slots_and_the_new_prompts_bank_rows(models):
  steps = Engine(models["qwen3"], with_sd(CONFIG, "s2_2_4"), SamplingParams(max_new_tokens=8)).steps
  st = filled_state(steps, 4, seed=1)
  new = SlotRows(*[np.asarray([-1, v, -1, v + 1], np.int32) for v in (7, 1, 5, 3, 2, 24, 10)])
  clear = np.zeros((steps.config.bank_rows,), bool)
  clear[2] = True
  out = jax.jit(steps.reset)(st, new, clear)
  a, b, fresh = jax.device_get((st, out, jax.jit(steps.init)(new)))
  for name, x in vars(b.per_row()).items():
    if x is not None:
      np.testing.assert_array_equal(x[[0, 2]], getattr(a, name)[[0, 2]], err_msg=name)  # other slots unchanged
      np.testing.assert_array_equal(x[[1, 3]], getattr(fresh, name)[[1, 3]], err_msg=name)  # as init makes them
  for name in ("k", "v", "lengths"):  # the prefill overwrites what a new row reads
    np.testing.assert_array_equal(getattr(b.cache, name), getattr(a.cache, name))
  assert (b.bank[2] == -1).all()
  np.testing.assert_array_equal(np.delete(b.bank, 2, 0), np.delete(a.bank, 2, 0))


def test_resume_brings_a_preempted_row_back_as_it_was(models):
  """A row decoded for a while, then prefilled again into other pages with its prompt and resumed
  with its tokens, holds what it held: its outputs and bank region exactly, its target and drafter
  caches (read through the new pages), last drafter output and captured hidden states up to float
  noise; its neighbour is untouched."""
  model = models["qwen3"]
  drafter = Drafter(model.config, rngs=nnx.Rngs(6))
  config = configured(CONFIG, strategies=(Strategy.parse("2_2_4"), Strategy.parse("s2_2_4")), capture_hidden=True,
                      page_size=16, num_pages=18)
  params = SamplingParams(temperature=1.0, max_new_tokens=64, seed=8)
  graphdef, weights = nnx.split(model)
  drafter_graphdef, drafter_weights = nnx.split(drafter)
  steps = steps_lib.Steps(config, params, model.config, graphdef, drafter_graphdef, jnp.float32)
  m = config.pages_per_row  # 6 pages of 16 slots per row: row 0 first holds pages 0-5, then 12-17
  before, after = np.arange(2 * m, dtype=np.int32).reshape(2, m), np.arange(2 * m, 3 * m, dtype=np.int32)
  after = np.stack([after, before[1]])
  ps = prompts(2, seed=33)
  tokens, lengths = padded(ps)
  ids = np.arange(2, dtype=np.int32)
  rows = SlotRows(prompt_index=ids, sample_index=ids * 0, row_id=ids, max_new=np.full((2,), 64, np.int32),
                  bank_row=ids, bank_offset=np.full((2,), CONFIG.max_prompt_len, np.int32),
                  bank_room=np.full((2,), 64, np.int32))
  prefill = jax.jit(steps.prefill)
  st = prefill(weights, drafter_weights, jax.jit(steps.init)(rows, before), tokens, lengths, ids,
               np.zeros((2, 0), np.int32), np.zeros((2,), np.int32), before)
  segment = jax.jit(functools.partial(steps.segment, strategy=None))
  for _ in range(3):
    st = segment(weights, drafter_weights, st, 0, before)
  a = jax.device_get(st)
  k = int(a.num_generated[0])
  assert 20 < k < 64 and not a.done.any()

  gone = SlotRows(*[np.asarray([x[0], -1], np.int32) for x in dataclasses.astuple(rows)])
  st = jax.jit(steps.reset)(st, gone, np.asarray([True, False, False, False, False, False, False, False, False]))
  st = prefill(weights, drafter_weights, st, tokens[:1], lengths[:1], np.asarray([0, -1], np.int32),
               np.zeros((1, 0), np.int32), np.zeros((2,), np.int32), after)
  r = config.resume_bucket(k)
  kept = np.zeros((r + 1,), np.int32)
  kept[0], kept[1:k + 1] = ps[0][-1], a.tokens[0, :k]
  logprobs = np.zeros((r,), np.float32)
  logprobs[:k] = a.logprobs[0, :k]
  b = jax.device_get(jax.jit(steps.resume)(weights, drafter_weights, st, np.int32(0), kept, logprobs, np.int32(k),
                                           after))

  for name in ("tokens", "logprobs", "num_generated", "last_token", "done", "finish", "row_id"):
    np.testing.assert_array_equal(getattr(b, name), getattr(a, name), err_msg=name)
  np.testing.assert_array_equal(b.bank, a.bank)
  np.testing.assert_allclose(b.hidden[:, :k], a.hidden[:, :k], atol=1e-5)
  np.testing.assert_allclose(b.draft_feat, a.draft_feat, atol=1e-5)

  def held(cache, table, row):  # [L, n, K, D] of the row's first `lengths[row]` slots, read through its pages
    s = np.arange(cache.lengths[row])
    return cache.k[:, table[row, s // 16], s % 16], cache.v[:, table[row, s // 16], s % 16]

  for name in ("cache", "drafter_cache"):
    x, y = getattr(a, name), getattr(b, name)
    np.testing.assert_array_equal(y.lengths, x.lengths, err_msg=name)
    for row in (0, 1):
      for u, v in zip(held(y, after, row), held(x, before, row)):
        np.testing.assert_allclose(u, v, atol=1e-5, err_msg=f"{name} row {row}")


@pytest.mark.parametrize("page", [16, 32])  # the tail padded to the page; to a bucket below it
def test_a_late_sibling_prefills_only_its_prompt_tail(models, page):
  """A sample entering while a sibling holds its prompt's shared page runs only the prompt's tail
  after it, and gets what a prefill of its prompt gives it: its first token exactly, its log-prob,
  target and drafter caches (read through its pages), drafter output and captured hidden states
  up to float noise."""
  model = models["qwen3"]
  drafter = Drafter(model.config, rngs=nnx.Rngs(7))
  config = configured(CONFIG, strategies=(Strategy.parse("2_2_4"),), capture_hidden=True, page_size=page,
                      num_pages=12, max_prompt_len=40, kv_block=16)
  params = SamplingParams(temperature=1.0, max_new_tokens=64, seed=9)
  graphdef, weights = nnx.split(model)
  drafter_graphdef, drafter_weights = nnx.split(drafter)
  steps = steps_lib.Steps(config, params, model.config, graphdef, drafter_graphdef, jnp.float32)
  m = config.pages_per_row
  table = np.stack([np.arange(m), np.concatenate([[0], np.arange(m, 2 * m - 1)])]).astype(np.int32)  # page 0 shared
  prompt = np.random.RandomState(5).randint(2, 60, page + 5).tolist()  # a page shared, 5 slots in each row's own
  tokens, lengths = padded([prompt], 40)
  rows = SlotRows(prompt_index=np.zeros((2,), np.int32), sample_index=np.arange(2, dtype=np.int32),
                  row_id=np.arange(2, dtype=np.int32), max_new=np.full((2,), 64, np.int32),
                  bank_row=np.zeros((2,), np.int32),
                  bank_offset=40 + 64 * np.arange(2, dtype=np.int32),
                  bank_room=np.full((2,), 64, np.int32))
  init, prefill = jax.jit(steps.init), jax.jit(steps.prefill)
  history = np.zeros((1, 0), np.int32)
  # Both samples in one prefill (the second writes from its own page on) ...
  a = jax.device_get(prefill(weights, drafter_weights, init(rows, table), tokens, lengths, np.zeros((2,), np.int32),
                             history, np.asarray([0, page], np.int32), table))
  # ... or the first, then the second's tail after the page the first wrote.
  st = prefill(weights, drafter_weights, init(rows, table), tokens, lengths, np.asarray([0, -1], np.int32), history,
               np.zeros((2,), np.int32), table)
  tail = np.zeros((config.tail_bucket(5),), np.int32)
  assert len(tail) == 16
  tail[:5] = prompt[page:]
  b = jax.device_get(jax.jit(steps.prefill_tail)(weights, drafter_weights, st, np.int32(1), tail, np.int32(page),
                                                  np.int32(5), np.int32(0), table))
  for name in ("tokens", "num_generated", "last_token", "done", "bank"):
    np.testing.assert_array_equal(getattr(b, name), getattr(a, name), err_msg=name)
  np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
  np.testing.assert_allclose(b.prompt_hidden[:, :page + 5], a.prompt_hidden[:, :page + 5], atol=1e-5)
  np.testing.assert_allclose(b.hidden[:, :1], a.hidden[:, :1], atol=1e-5)
  for name in ("cache", "drafter_cache"):
    x, y = getattr(a, name), getattr(b, name)
    np.testing.assert_array_equal(y.lengths, x.lengths, err_msg=name)
    for row in (0, 1):
      s = np.arange(x.lengths[row])
      for u, v in ((y.k, x.k), (y.v, x.v)):
        np.testing.assert_allclose(u[:, table[row, s // page], s % page], v[:, table[row, s // page], s % page],
                                   atol=1e-5, err_msg=f"{name} row {row}")
  np.testing.assert_allclose(b.draft_feat, a.draft_feat, atol=1e-5)
