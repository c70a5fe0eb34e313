"""Speculative decoding: strategies, draft trees, lossless acceptance (chi-square), stops/budgets, commit."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy import special, stats

from tlt_jax.models.transformer import KVCache
from tlt_jax.rollout import sampling, speculative
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.speculative import Strategy

# The acceptance tests' tree: root 0; 1, 2 under the root; 3, 4 under 1; 5 under 2; 6 under 3.
PARENTS = np.asarray([-1, 0, 0, 1, 1, 2, 3])
DEPTHS = np.asarray([0, 1, 1, 2, 2, 2, 3])
DEPTH = 3
N = 10  # target vocabulary

jit_accept = jax.jit(speculative.accept, static_argnames=("params", "max_depth"))
jit_draft_tree = jax.jit(speculative.draft_tree, static_argnums=(0, 1, 5), static_argnames="params")


# ---- strategies and masks ----


def test_strategy_parse_name_window():
  s = Strategy.parse("4_2_8")
  assert (s.depth, s.top_k, s.verify_tokens, s.name) == (4, 2, 8, "4_2_8")
  assert Strategy.parse(Strategy(6, 1, 4).name) == Strategy(6, 1, 4)
  # The widest of: the verified tree, the drafter's levels, the drafter catch-up of depth + 1 tokens.
  assert Strategy(4, 2, 8).window == 8
  assert Strategy(3, 4, 5).window == 8
  assert Strategy(6, 1, 4).window == 7
  # Suffix strategies: drafted from the token bank, no drafter levels; up to top_k x depth candidates.
  s = Strategy.parse("s4_2_9")
  assert (s.depth, s.top_k, s.verify_tokens, s.suffix, s.name) == (4, 2, 9, True, "s4_2_9")
  assert Strategy.parse(s.name) == s != Strategy.parse("4_2_9")
  assert Strategy.parse("s3_4_5").window == 5 and Strategy.parse("s6_1_4").window == 7


@pytest.mark.parametrize("name", ["4_2", "4_2_8_1", "a_2_8", "0_2_4", "4_0_4", "4_2_1", "2_2_8", "1_3_5"])
def test_bad_strategy_rejected(name):
  with pytest.raises(ValueError, match=re.escape(name)):
    Strategy.parse(name)


def test_ancestor_mask_hand_built():
  expected = np.zeros((7, 7), bool)
  for i, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]):
    expected[i, ancestors] = True
  chain = np.tril(np.ones((7, 7), bool))
  parents = jnp.asarray([PARENTS, np.arange(-1, 6)])
  np.testing.assert_array_equal(speculative.ancestor_mask(parents, 6), [expected, chain])
  np.testing.assert_array_equal(speculative.ancestor_mask(parents[:1], 3)[0], expected)


# ---- draft trees ----

DV, H = 12, 6  # drafter vocabulary, feature width
_rng = np.random.RandomState(1)
A, EMB, WOUT = _rng.normal(0, 0.8, (H, H)), _rng.normal(0, 1, (DV, H)), _rng.normal(0, 2, (H, DV))


def logits_fn(features):
  return features @ jnp.asarray(WOUT, jnp.float32)


def draft_fn(cache, feats_BxKxH, tokens_BxK, positions_BxK, mask_BxKxW):
  """Writes the frontier's tokens to the last K window slots; features mix in the masked window's tokens."""
  b, t = tokens_BxK.shape
  w = mask_BxKxW.shape[2]
  rows = jnp.arange(b)[:, None]
  k = cache.k.at[0, rows, cache.lengths[:, None] + w - t + jnp.arange(t), 0, 0].set(tokens_BxK.astype(jnp.float32))
  window_BxW = k[0, rows, cache.lengths[:, None] + jnp.arange(w), 0, 0].astype(jnp.int32)
  path = jnp.einsum("bkw,bwh->bkh", mask_BxKxW.astype(jnp.float32), jnp.asarray(EMB, jnp.float32)[window_BxW])
  out = jnp.tanh(feats_BxKxH @ jnp.asarray(A, jnp.float32) + path + jnp.cos(positions_BxK)[..., None])
  return out, KVCache(k, cache.v, cache.lengths)


def reference_pool(feat_H, length, strategy):
  """Every drafted candidate (token path -> cumulative draft log-prob), expanding the top-k frontier by hand."""

  def children(h):
    lp = h @ WOUT - special.logsumexp(h @ WOUT)
    return [(t, lp[t]) for t in np.argsort(-lp)[:strategy.top_k]]

  pool = {(t,): s for t, s in children(feat_H)}
  frontier = [(path, s, feat_H) for path, s in pool.items()]
  for _ in range(strategy.depth - 1):
    cands = []
    for path, s, parent_h in frontier:
      h = np.tanh(parent_h @ A + EMB[list(path)].sum(0) + np.cos(length + len(path) - 1))
      cands += [(path + (t,), s + c, h) for t, c in children(h)]
    pool.update({path: s for path, s, _ in cands})
    frontier = sorted(cands, key=lambda c: -c[1])[:strategy.top_k]
  return pool


@pytest.mark.parametrize("name", ["4_3_12", "3_2_11", "2_4_6", "5_1_4"])
def test_draft_tree_is_the_best_valid_tree(name):
  strategy = Strategy.parse(name)
  rng = np.random.RandomState(2)
  b, v = 3, strategy.verify_tokens
  feat = rng.normal(0, 1, (b, H))
  root = jnp.asarray([5, 0, 11])
  lengths = jnp.asarray([0, 3, 7], jnp.int32)
  zeros = jnp.zeros((1, b, 32, 1, 1))
  tree, cache = jit_draft_tree(draft_fn, logits_fn, jnp.asarray(feat, jnp.float32), root,
                               KVCache(zeros, zeros, lengths), strategy)
  np.testing.assert_array_equal(cache.lengths, lengths)
  tokens, parents, depths = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depths))
  assert tokens.shape == parents.shape == depths.shape == (b, v)
  np.testing.assert_array_equal(tokens[:, 0], root)
  np.testing.assert_array_equal(parents[:, 0], -1)
  np.testing.assert_array_equal(depths[:, 0], 0)
  np.testing.assert_array_equal(tree.mask, speculative.ancestor_mask(tree.parents, strategy.depth))
  for r in range(b):
    paths = {0: ()}
    for i in range(1, v):
      p = parents[r, i]
      assert 0 <= p < i and depths[r, i] == depths[r, p] + 1 <= strategy.depth
      siblings = tokens[r, 1:][parents[r, 1:] == p]
      assert len(siblings) <= strategy.top_k and len(set(siblings.tolist())) == len(siblings)
      paths[i] = paths[p] + (int(tokens[r, i]),)
    pool = reference_pool(feat[r], int(lengths[r]), strategy)
    ranked = sorted(pool, key=lambda path: -pool[path])
    if len(ranked) > v - 1:  # the kept set is only defined away from ties
      assert pool[ranked[v - 2]] - pool[ranked[v - 1]] > 1e-4
    assert set(paths.values()) - {()} == set(ranked[:v - 1])
  if strategy.top_k == 1:
    np.testing.assert_array_equal(parents, np.broadcast_to(np.arange(-1, v - 1), (b, v)))


def position_draft_fn(cache, feats_BxKxH, tokens_BxK, positions_BxK, mask_BxKxW):
  """A drafter whose prediction depends on the position alone (every node of a level: the same q)."""
  return jnp.broadcast_to(position_features(positions_BxK), feats_BxKxH.shape), cache


def position_features(positions):
  return jnp.tanh(jnp.cos(positions.astype(jnp.float32))[..., None] * jnp.asarray(A[0], jnp.float32) * 3)


# A chain, and a tree: coupled, all its candidates (every level's first child kept); ranked, 6 of 11.
@pytest.mark.parametrize("coupled_name,ranked_name", [("4_1_5", "4_1_5"), ("3_2_11", "3_2_6")])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=3),
                                    SamplingParams(temperature=0.7, top_p=0.9, seed=5)], ids=["t1", "t0.7_p0.9"])
def test_sampled_drafts_of_the_targets_distribution_are_all_accepted(coupled_name, ranked_name, params):
  # The drafter's distribution at each depth IS the target's there: a draft coupled to the keys
  # the target draws with is accepted at every depth. Ranked by the drafter's most likely tokens
  # (`keys_BxD` None), the draft is accepted with the probability of those tokens only.
  b = 64
  rng = np.random.RandomState(6)
  feat = jnp.asarray(rng.normal(0, 1, (b, H)), jnp.float32)
  lengths = jnp.asarray(rng.randint(0, 20, b), jnp.int32)
  prompt, sample, generated = (jnp.asarray(rng.randint(0, 50, b)) for _ in range(3))
  zeros = jnp.zeros((1, b, 64, 1, 1))
  # Target logits at a depth-j node: the drafter's for depth j + 1 (level 1 from feat, level d from position).
  depth = Strategy.parse(coupled_name).depth
  level_logits = [logits_fn(feat)] + [logits_fn(position_features(lengths + d - 2)) for d in range(2, depth + 2)]
  counts = {}
  for coupled in (True, False):
    strategy = Strategy.parse(coupled_name if coupled else ranked_name)
    keys = speculative.draft_keys(params, prompt, sample, generated, strategy.depth) if coupled else None
    tree, _ = jit_draft_tree(position_draft_fn, logits_fn, feat, jnp.zeros((b,), jnp.int32),
                             KVCache(zeros, zeros, lengths), strategy, params=params, keys_BxD=keys)
    target = jnp.stack(level_logits, 1)[jnp.arange(b)[:, None], tree.depths]
    acc = jit_accept(target, tree, jnp.ones((b,), bool), generated, generated + 100, prompt, sample,
                     params=params, max_depth=strategy.depth)
    counts[coupled] = np.asarray(acc.count)
  np.testing.assert_array_equal(counts[True], depth + 1)
  assert (counts[False] < depth + 1).mean() > 0.2


def test_a_reduced_head_holding_the_targets_distribution_couples_to_the_targets_draw():
  """A head of some target ids (increasing, every possible token and a few impossible ones) holding
  the target's distribution puts its coupled child (scored first) on the target's draw with every key:
  the draw is made over the target's vocabulary, noise keyed by block and token id."""
  rng = np.random.RandomState(1)
  v, n = 700, 2000
  p = rng.dirichlet(np.full(v, 0.3))
  p[rng.choice(v, 300, replace=False)] = 0
  p /= p.sum()
  head = np.sort(np.concatenate([np.flatnonzero(p > 0), rng.choice(np.flatnonzero(p == 0), 5, replace=False)]))
  keys = sampling.row_keys(2, jnp.zeros(n, jnp.int32), jnp.arange(n), jnp.zeros(n, jnp.int32))
  with np.errstate(divide="ignore"):
    logp = jnp.broadcast_to(jnp.asarray(np.log(p), jnp.float32), (n, v))
  target = np.asarray(sampling.draw(logp, keys))
  scores = speculative.level_scores(logp[:, head], SamplingParams(temperature=1.0), keys,
                                    lambda i: jnp.asarray(head)[i], v)
  np.testing.assert_array_equal(head[np.asarray(jnp.argmax(scores, -1))], target)
  scores = np.asarray(scores)
  assert (scores == scores.max(-1, keepdims=True)).sum(-1).max() == 1


def test_sampled_children_hold_more_of_the_targets_draws_than_the_drafters_top_k():
  """With the level's key the known noise ranks the children with q: for a q near p (a drafter's
  error on the log-probs), the target's draw falls among the top 4 children more often than among
  q's 4 most likely tokens (whose rate is p's mass on them) or the coupled draw with q's top 3; the
  siblings of the coupled child (scored first) score log-probabilities."""
  rng = np.random.RandomState(2)
  v, n = 600, 4000
  logp = jax.nn.log_softmax(jnp.asarray(2.0 * rng.normal(size=(n, v)), jnp.float32), -1)
  logq = jax.nn.log_softmax(logp + jnp.asarray(rng.normal(size=(n, v)), jnp.float32), -1)
  keys = sampling.row_keys(4, jnp.zeros(n, jnp.int32), jnp.arange(n), jnp.zeros(n, jnp.int32))
  target = np.asarray(sampling.draw(logp, keys))[:, None]
  params = SamplingParams(temperature=1.0)
  scores = speculative.level_scores(logq, params, keys)
  children = np.asarray(jax.lax.top_k(scores, 4)[1])
  by_q = np.asarray(jax.lax.top_k(logq, 4)[1])
  coupled = np.asarray(sampling.draw(logq, keys))[:, None]
  with_coupled = np.asarray(jax.lax.top_k(jnp.where(jnp.arange(v) == coupled, 0.0, logq), 4)[1])
  rate = lambda ids: (ids == target).any(-1).mean()
  assert rate(children) > rate(with_coupled) + 0.02 > rate(by_q) + 0.04
  scores = np.asarray(scores)
  others = np.where(scores == scores.max(-1, keepdims=True), -np.inf, scores)
  assert (np.exp(others).sum(-1) < 1).all()


# ---- acceptance ----


def make_tree(logits_BxVxN, ranks_BxV, root_B):
  """Tree PARENTS whose node i holds the ranks[i]-th most likely token of its parent's logits."""
  b = logits_BxVxN.shape[0]
  order = np.argsort(-logits_BxVxN, axis=-1)
  tokens = order[np.arange(b)[:, None], np.maximum(PARENTS, 0)[None], ranks_BxV]
  tokens[:, 0] = root_B
  parents = jnp.asarray(np.broadcast_to(PARENTS, (b, len(PARENTS))))
  return speculative.Tree(jnp.asarray(tokens, jnp.int32), parents, jnp.asarray(np.broadcast_to(DEPTHS, parents.shape)),
                          speculative.ancestor_mask(parents, DEPTH))


def target_probs(logits_VxN, params):
  """The sampling distribution at each node, in float64 numpy (temperature, then top-k, then top-p)."""
  x = logits_VxN.astype(np.float64) / params.temperature
  if params.top_k:
    x = np.where(x < np.sort(x, -1)[:, -params.top_k:][:, :1], -np.inf, x)
  p = np.exp(x - x.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  if params.top_p < 1:
    desc = -np.sort(-p, -1)
    n_keep = ((np.cumsum(desc, -1) - desc) < params.top_p).sum(-1, keepdims=True)
    p = np.where(p < np.take_along_axis(desc, n_keep - 1, -1), 0, p)
    p /= p.sum(-1, keepdims=True)
  return p


def assert_follows(counts, probs):
  """Chi-square goodness of fit; probability-0 cells must be empty, rare cells are pooled to expected >= 5."""
  counts, probs = np.ravel(counts), np.ravel(probs)
  assert counts[probs == 0].sum() == 0
  expected = probs[probs > 0] * counts.sum()
  order = np.argsort(expected)
  counts, expected = counts[probs > 0][order], expected[order]
  pooled = max(np.sum(expected < 5), np.searchsorted(np.cumsum(expected), 5) + 1) if expected[0] < 5 else 0
  if pooled:
    counts = np.concatenate([[counts[:pooled].sum()], counts[pooled:]])
    expected = np.concatenate([[expected[:pooled].sum()], expected[pooled:]])
  assert len(expected) >= 2
  assert stats.chisquare(counts, expected).pvalue > 1e-3


LOSSLESS_LOGITS = np.random.RandomState(3).normal(0, 1.5, (len(PARENTS), N)).astype(np.float32)
# Root and node 1 offer their two most likely tokens, node 3 its most likely one, node 2 its least likely.
LOSSLESS_RANKS = np.asarray([[0, 0, 1, 0, 1, N - 1, 0]])


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=3, seed=1),
                                    SamplingParams(top_p=0.7, seed=2)], ids=["plain", "top_k", "top_p"])
def test_acceptance_is_lossless(params):
  b = 100_000
  tree = make_tree(LOSSLESS_LOGITS[None], LOSSLESS_RANKS, [7])
  tree = jax.tree.map(lambda x: jnp.broadcast_to(x, (b,) + x.shape[1:]), tree)
  zeros = jnp.zeros((b,), jnp.int32)
  acc = jit_accept(jnp.broadcast_to(LOSSLESS_LOGITS, (b,) + LOSSLESS_LOGITS.shape), tree, jnp.ones((b,), bool),
                   zeros, zeros + 1000, zeros, jnp.arange(b), params=params, max_depth=DEPTH)
  p = target_probs(LOSSLESS_LOGITS, params)
  tokens, count, nodes = np.asarray(acc.tokens), np.asarray(acc.count), np.asarray(acc.nodes)
  assert not np.asarray(acc.stop).any() and not np.asarray(acc.length).any()
  # (a) the first token follows the root's distribution.
  assert_follows(np.bincount(tokens[:, 0], minlength=N), p[0])
  # (b) (x1, x2) ~ p_root(x1) p_child(x1)(x2) when x1 is a child of the root; otherwise x1 ends the step
  # (column N). Cells of probability 0 hold every other outcome.
  child_of = {int(t): c for c, t in enumerate(np.asarray(tree.tokens[0])) if PARENTS[c] == 0}
  joint = np.zeros((N, N + 1))
  for x1 in range(N):
    joint[x1] = np.append(p[0, x1] * p[child_of[x1]], 0) if x1 in child_of else np.eye(N + 1)[N] * p[0, x1]
  second = np.where(count >= 2, tokens[:, 1], N)
  assert_follows(np.bincount(tokens[:, 0] * (N + 1) + second, minlength=N * (N + 1)), joint)
  has_second = count >= 2
  np.testing.assert_array_equal(nodes[has_second, 1], [child_of[x] for x in tokens[has_second, 0]])
  lp = np.log(p[nodes[:, :2], tokens[:, :2]])
  np.testing.assert_allclose(np.asarray(acc.logprobs)[:, 0], lp[:, 0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(acc.logprobs)[has_second, 1], lp[has_second, 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_p=0.95, seed=7), SamplingParams(temperature=0)],
                         ids=["sampled", "greedy"])
def test_every_emitted_token_is_plain_decodings_sample(params):
  b = 256
  rng = np.random.RandomState(4)
  logits = rng.normal(0, 1.5, (b, len(PARENTS), N)).astype(np.float32)
  # Siblings take distinct ranks among the three most likely tokens, so a child matches the argmax sometimes.
  ranks = np.zeros((b, len(PARENTS)), int)
  for r in range(b):
    for parent in range(len(PARENTS)):
      kids = np.flatnonzero(PARENTS == parent)
      ranks[r, kids] = rng.permutation(3)[:len(kids)]
  tree = make_tree(logits, ranks, rng.randint(0, N, b))
  prompt, sample, generated = (jnp.asarray(rng.randint(0, 50, b)) for _ in range(3))
  acc = jit_accept(jnp.asarray(logits), tree, jnp.ones((b,), bool), generated, generated + 100, prompt, sample,
                   params=params, max_depth=DEPTH)
  tokens, nodes, count = np.asarray(acc.tokens), np.asarray(acc.nodes), np.asarray(acc.count)
  tree_tokens = np.asarray(tree.tokens)
  rows = np.arange(b)
  np.testing.assert_array_equal(nodes[:, 0], 0)
  assert (count >= 1).all() and (count >= 3).any() and (count == 1).any()
  for j in range(DEPTH + 1):
    keys = sampling.row_keys(params.seed, prompt, sample, generated + j)
    want, want_lp = sampling.sample(sampling.log_probs(jnp.asarray(logits[rows, nodes[:, j]]), params), keys, params)
    live = count > j
    np.testing.assert_array_equal(tokens[live, j], np.asarray(want)[live])
    if params.greedy:
      np.testing.assert_array_equal(tokens[live, j], logits[rows, nodes[:, j]].argmax(-1)[live])
    np.testing.assert_allclose(np.asarray(acc.logprobs)[live, j], np.asarray(want_lp)[live], atol=1e-6)
    # The walk descends into the child holding the drawn token, and ends (bonus) exactly when there is none.
    is_child = (PARENTS[None] == nodes[:, j, None]) & (tree_tokens == tokens[:, j, None])
    np.testing.assert_array_equal(is_child.any(1)[live], (count > j + 1)[live])
    if j < DEPTH:
      descend = count > j + 1
      np.testing.assert_array_equal(nodes[descend, j + 1], is_child.argmax(1)[descend])


STOP = 1


@pytest.mark.parametrize("path, generated, max_new, active, count, stop, length", [
    ([2, 3, 4, 5], 0, 100, True, 4, False, False),  # the whole chain plus the bonus
    ([2, STOP, 4, 5], 0, 100, True, 2, True, False),  # a stop token at an accepted child ends the walk
    ([2, 3, 4, STOP], 0, 100, True, 4, True, False),  # a stop bonus
    ([STOP, 3, 4, 5], 0, 100, True, 1, True, False),  # a stop token at the root
    ([2, 3, 4, 5], 5, 7, True, 2, False, True),  # the budget cuts the walk
    ([2, 3, 4, 5], 6, 7, True, 1, False, True),
    ([2, 3, 4, 5], 5, 9, True, 4, False, True),  # the walk ends exactly at the budget
    ([2, 3, 4, 5], 5, 10, True, 4, False, False),
    ([2, STOP, 4, 5], 5, 7, True, 2, True, False),  # a stop token as the last budgeted token is a stop
    ([2, 3, 4, 5], 0, 100, False, 0, False, False),  # inactive rows emit nothing
])
def test_stop_tokens_and_budgets(path, generated, max_new, active, count, stop, length):
  # Chain root -> 1 -> 2 -> 3 holding path[:3]; node i's argmax is path[i], so greedy accepts every node.
  parents = jnp.asarray([[-1, 0, 1, 2]])
  tree = speculative.Tree(jnp.asarray([[9] + path[:3]]), parents, jnp.arange(4)[None],
                          speculative.ancestor_mask(parents, 3))
  logits = 5 * np.eye(N, dtype=np.float32)[path][None]
  one = lambda x: jnp.asarray([x])
  acc = jit_accept(jnp.asarray(logits), tree, one(active), one(generated), one(max_new), one(0), one(0),
                   params=SamplingParams(temperature=0, stop_token_ids=(STOP,)), max_depth=3)
  assert (int(acc.count[0]), bool(acc.stop[0]), bool(acc.length[0])) == (count, stop, length)
  np.testing.assert_array_equal(acc.tokens[0, :count], path[:count])
  np.testing.assert_array_equal(acc.nodes[0, :count], np.arange(count))


# ---- property-based: random trees, targets, stop tokens and budgets ----

FUZZ_ROWS, FUZZ_N, FUZZ_STOPS = 8, 12, (1, 2)
GREEDY = SamplingParams(temperature=0, stop_token_ids=FUZZ_STOPS)
SAMPLED = SamplingParams(temperature=0.9, top_k=6, top_p=0.9, stop_token_ids=FUZZ_STOPS, seed=5)
# (tree shape, sampling): three compilations shared by all examples.
FUZZ_CASES = ((Strategy(3, 2, 6), GREEDY), (Strategy(4, 1, 5), GREEDY), (Strategy(3, 2, 6), SAMPLED))
jit_ancestor_mask = jax.jit(speculative.ancestor_mask, static_argnums=1)


@st.composite
def fuzz_row(draw, strategy):
  """One row: target logits on a coarse grid (exact ties happen), a tree of the strategy's shape whose
  nodes hold their parent's rank-r token (r often 0, so greedy walks go deep), activity and budget."""
  v = strategy.verify_tokens
  logits = draw(hnp.arrays(np.int8, (v, FUZZ_N), elements=st.integers(-3, 3))).astype(np.float32) * 1.5
  order = np.argsort(-logits, axis=-1, kind="stable")  # rank 0 is the argmax (first of ties)
  parents, depths, tokens = [-1], [0], [draw(st.integers(0, FUZZ_N - 1))]
  for i in range(1, v):
    open_nodes = [n for n in range(i) if depths[n] < strategy.depth and parents.count(n) < strategy.top_k]
    p = draw(st.sampled_from(open_nodes))
    free = [r for r in range(FUZZ_N) if order[p, r] not in [tokens[c] for c in range(i) if parents[c] == p]]
    rank = free[0] if draw(st.integers(0, 3)) else draw(st.sampled_from(free))
    parents.append(p)
    depths.append(depths[p] + 1)
    tokens.append(int(order[p, rank]))
  generated = draw(st.integers(0, 20))
  return dict(logits=logits, parents=parents, depths=depths, tokens=tokens, active=draw(st.booleans() | st.just(True)),
              generated=generated, max_new=generated + draw(st.integers(1, 2 * strategy.depth + 2)),
              prompt=draw(st.integers(0, 1000)), sample=draw(st.integers(0, 16)))




def reference_walk(row, strategy, draw_at):
  """Brute force: (tokens, nodes, stop, length) of the walk; draw_at(node, j) is the target's token at `node`."""
  tokens, nodes, node = [], [], 0
  for j in range(strategy.depth + 1 if row["active"] else 0):
    x = draw_at(node, j)
    tokens.append(x)
    nodes.append(node)
    if x in FUZZ_STOPS:
      return tokens, nodes, True, False
    if row["generated"] + j + 1 >= row["max_new"]:
      return tokens, nodes, False, True
    kids = [c for c in range(strategy.verify_tokens) if row["parents"][c] == node and row["tokens"][c] == x]
    if not kids:
      break
    node = kids[0]
  return tokens, nodes, False, False


@pytest.mark.parametrize("strategy, params", FUZZ_CASES, ids=["greedy_tree", "greedy_chain", "sampled_tree"])
@settings(max_examples=35)
@given(data=st.data())
def test_fuzz_acceptance_is_valid_and_greedy_lossless(strategy, params, data):
  rows = data.draw(st.lists(fuzz_row(strategy), min_size=FUZZ_ROWS, max_size=FUZZ_ROWS))
  x = {k: np.asarray([r[k] for r in rows]) for k in rows[0]}
  mask = np.zeros(x["parents"].shape + x["parents"].shape[-1:], bool)  # ancestor-or-self, by walking up
  for r, i in np.ndindex(x["parents"].shape):
    a = i
    while a >= 0:
      mask[r, i, a], a = True, x["parents"][r, a]
  np.testing.assert_array_equal(jit_ancestor_mask(jnp.asarray(x["parents"]), strategy.depth), mask)
  tree = speculative.Tree(*(jnp.asarray(x[k], jnp.int32) for k in ("tokens", "parents", "depths")), jnp.asarray(mask))
  acc = jit_accept(jnp.asarray(x["logits"]), tree, *(jnp.asarray(x[k]) for k in ("active", "generated", "max_new",
                   "prompt", "sample")), params=params, max_depth=strategy.depth)
  out = {k: np.asarray(getattr(acc, k)) for k in ("tokens", "logprobs", "nodes", "count", "stop", "length")}
  for r in range(FUZZ_ROWS):
    row = {k: v[r] for k, v in x.items()}
    n = out["count"][r]
    tokens, nodes = out["tokens"][r, :n].tolist(), out["nodes"][r, :n].tolist()
    # Valid for any target: a root-to-node path of the tree, within the budget, nothing after a stop.
    assert n <= strategy.depth + 1 and row["generated"] + n <= row["max_new"] and (n > 0) == row["active"]
    assert nodes[:1] == [0][:n] and all(row["parents"][c] == p for p, c in zip(nodes, nodes[1:]))
    assert all(row["tokens"][c] == t for c, t in zip(nodes[1:], tokens))
    assert not set(tokens[:-1]) & set(FUZZ_STOPS) and out["stop"][r] == (n > 0 and tokens[-1] in FUZZ_STOPS)
    assert out["length"][r] == (n > 0 and not out["stop"][r] and row["generated"] + n == row["max_new"])
    # Greedy: exactly the target's greedy continuation; sampled: the walk the drawn tokens imply.
    draw_at = (lambda node, j: int(np.argmax(row["logits"][node]))) if params.greedy else (lambda node, j: tokens[j])
    assert reference_walk(row, strategy, draw_at) == (tokens, nodes, out["stop"][r], out["length"][r])
    p = target_probs(row["logits"], params) if not params.greedy else special.softmax(row["logits"], -1)
    np.testing.assert_allclose(out["logprobs"][r, :n], np.log(p[nodes, tokens]), atol=1e-5)
  for what, rows in (("a stop token", out["stop"]), ("the budget", out["length"]),
                     ("the full depth", out["count"] > strategy.depth)):
    if rows.any():
      event(f"some row ended by {what}")


@settings(max_examples=20)
@given(st.sampled_from(["4_3_12", "2_4_6"]), hnp.arrays(np.float32, (3, H), elements=st.floats(-3, 3, width=32)),
       hnp.arrays(np.int32, 3, elements=st.integers(0, DV - 1)), hnp.arrays(np.int32, 3, elements=st.integers(0, 20)))
def test_fuzz_draft_tree_is_a_valid_tree(name, feat, root, lengths):
  strategy = Strategy.parse(name)
  zeros = jnp.zeros((1, 3, 32, 1, 1))  # the shapes of test_draft_tree_is_the_best_valid_tree: one compile
  tree, cache = jit_draft_tree(draft_fn, logits_fn, jnp.asarray(feat), jnp.asarray(root),
                               KVCache(zeros, zeros, jnp.asarray(lengths)), strategy)
  np.testing.assert_array_equal(cache.lengths, lengths)
  tokens, parents, depths = (np.asarray(a) for a in (tree.tokens, tree.parents, tree.depths))
  np.testing.assert_array_equal(tokens[:, 0], root)
  np.testing.assert_array_equal(tree.mask, jit_ancestor_mask(tree.parents, strategy.depth))
  for r in range(3):
    assert parents[r, 0] == -1 and depths[r, 0] == 0
    for i in range(1, strategy.verify_tokens):
      p = parents[r, i]
      assert 0 <= p < i and depths[r, i] == depths[r, p] + 1 <= strategy.depth and 0 <= tokens[r, i] < DV
      siblings = tokens[r, 1:][parents[r, 1:] == p]
      assert len(siblings) <= strategy.top_k and len(set(siblings.tolist())) == len(siblings)


# ---- commit ----


def test_commit_moves_the_accepted_path():
  layers, b, s, window = 2, 3, 16, 5
  ids = np.arange(layers)[:, None, None] * 10_000 + np.arange(b)[None, :, None] * 100 + np.arange(s)
  ids = ids.astype(np.float32)  # layer, row and slot of every entry
  k = np.broadcast_to(ids[..., None, None], (layers, b, s, 2, 3))
  lengths = np.asarray([2, 5, 11])
  nodes = np.asarray([[0, 1, 3, 4], [0, 2, 6, 6], [0, 1, 2, 3]])  # past `count`, nodes are garbage
  count = np.asarray([3, 2, 0])
  cache = speculative.commit(KVCache(jnp.asarray(k), jnp.asarray(-k), jnp.asarray(lengths)), jnp.asarray(nodes),
                             jnp.asarray(count))
  expected, defined = ids.copy(), np.ones(ids.shape, bool)
  for r, (n, c) in enumerate(zip(lengths, count)):  # slot n + j takes n + nodes[j]; the rest of the window is garbage
    expected[:, r, n:n + c] = ids[:, r, n + nodes[r, :c]]
    defined[:, r, n + c:n + window] = False
  np.testing.assert_array_equal(cache.lengths, lengths + count)
  np.testing.assert_array_equal(np.asarray(cache.k)[defined], expected[defined][:, None, None] + np.zeros((2, 3)))
  np.testing.assert_array_equal(cache.v, -np.asarray(cache.k))
