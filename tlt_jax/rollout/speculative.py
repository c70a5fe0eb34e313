"""Speculative decoding pieces: strategies, EAGLE-2 dynamic draft trees, lossless acceptance, commit.

Tree layout (static shapes, V = verify tokens): node 0 is the root (the last emitted token, not
yet in the target cache); nodes 1..V-1 are draft tokens ordered so that parents precede
children; `parents[0] = -1`; `mask[i, j]` is True iff j is i or an ancestor of i.

Acceptance is exact for any drafter. At the current node (the root first) the next token is
drawn from the target's sampling distribution p at that node with the key plain decoding would
use for that position; if it equals one of the node's children, the walk descends there and
repeats, otherwise it stops with that token as the bonus. Each child c is thus accepted with
probability p(c), and on rejection of all children the bonus follows p restricted to the other
tokens, renormalised: the target-only sequential scheme of REFERENCE.md section 3 (one draw per
depth against the siblings' cumulative target mass). Every emitted token is a sample of p with
plain decoding's own key, so a speculative rollout equals the plain one for any drafter, up to
float rounding of p.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.kernels import layout
from tlt_jax.models.transformer import KVCache
from tlt_jax.rollout import sampling
from tlt_jax.rollout.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Strategy:
  """Draft depth, branches, and tokens verified (root included), drafted by the EAGLE drafter or,
  `suffix`, from matches in the prompt's token bank (`tlt_jax.rollout.suffix`): then `top_k` is the
  number of matches whose continuations make the branches."""

  depth: int
  top_k: int
  verify_tokens: int
  suffix: bool = False

  def __post_init__(self):
    if self.depth < 1 or self.top_k < 1:
      raise ValueError(f"strategy {self.name}: depth and top_k must be >= 1")
    if self.suffix:
      candidates, what = self.top_k * self.depth, f"{self.top_k} matches' depth-{self.depth} continuations hold"
    else:
      candidates = self.top_k + (self.depth - 1) * self.top_k**2
      what = f"a depth-{self.depth}, top-{self.top_k} tree drafts"
    if not 2 <= self.verify_tokens <= 1 + candidates:
      raise ValueError(f"strategy {self.name}: verify_tokens must be in [2, {1 + candidates}] "
                       f"(root + the {candidates} candidates {what})")

  @property
  def name(self) -> str:
    return f"{'s' if self.suffix else ''}{self.depth}_{self.top_k}_{self.verify_tokens}"

  @classmethod
  def parse(cls, name: str, suffix_only: bool = False) -> "Strategy":
    """'depth_topk_verify', e.g. '4_2_8' (EAGLE; top_k 1 is chain drafting), or with an 's' in front,
    e.g. 's4_2_8', a suffix strategy (branches from 2 bank matches). `suffix_only` (no EAGLE
    drafter): both spellings name the suffix strategy."""
    suffix = name.startswith("s")
    if suffix_only and not suffix:
      return cls.parse("s" + name)
    try:
      depth, top_k, verify = (int(x) for x in name[suffix:].split("_"))
    except ValueError:
      raise ValueError(f"strategy {name!r} is not 'depth_topk_verify' (e.g. '4_2_8'), or 's' and that "
                       "for a suffix strategy (e.g. 's4_2_8')") from None
    return cls(depth, top_k, verify, suffix)

  @property
  def window(self) -> int:
    """Cache slots a step may write past a row's length (tree, drafter levels, catch-up)."""
    levels = 0 if self.suffix else (self.depth - 1) * self.top_k
    return max(self.verify_tokens, levels, self.depth + 1)


@flax.struct.dataclass
class Tree:
  tokens: jax.Array  # [B, V]
  parents: jax.Array  # [B, V], -1 for the root
  depths: jax.Array  # [B, V]
  mask: jax.Array  # [B, V, V] ancestor-or-self


def ancestor_mask(parents_BxV, depth: int):
  """[B, V, V] ancestor-or-self mask of trees of at most `depth` levels below the root."""
  b, v = parents_BxV.shape
  up = jnp.maximum(parents_BxV, 0)  # the root is its own parent
  mask = jnp.broadcast_to(jnp.eye(v, dtype=bool), (b, v, v))
  cur = jnp.broadcast_to(jnp.arange(v), (b, v))
  rows = jnp.arange(b)[:, None]
  for _ in range(depth):
    cur = up[rows, cur]
    mask = mask | jax.nn.one_hot(cur, v, dtype=bool)
  return mask


def draft_keys(params: SamplingParams, prompt_index_B, sample_index_B, num_generated_B, depth: int):
  """[B, depth] the keys `accept` will draw the tokens at depths 1..depth with (None: greedy)."""
  if params.greedy:
    return None
  return jnp.stack([sampling.row_keys(params.seed, prompt_index_B, sample_index_B, num_generated_B + d)
                    for d in range(depth)], axis=1)


# How much a sampled level's child ranking trusts the known noise of the target's draw over the
# drafter's q. SmolLM2-135M with its temperature-1 drafter, 64 held-out prompts at T=1: the draw fell
# among the first 4 children 0.67 / 0.63 / 0.60 of the time at draft depths 1 / 2 / 3, where q's own
# top 4 hold 0.53 / 0.51 / 0.48 of p (docs/BENCHMARKS.md, experiments/acceptance.py). The weight was
# chosen on 16 of those prompts (1 and 3 within 0.01 of 2; the coupled draw and q's top 3 0.05 lower)
# and held on 16 the drafter's training held out: 0.65 / 0.60 / 0.57 against 0.57 / 0.53 / 0.51.
# The coupled child's score, just above the level's best: on 32 held-out prompts at T=1 (4_4_16, the same
# responses) 2.14 tokens per verify, where scoring it 0 (certain, so its chain was always kept whole) gave 1.98.
NOISE_WEIGHT = 2.0


def level_scores(logits_BxN, params: SamplingParams | None, keys_B, to_target=lambda ids: ids,
                 vocab_size: int | None = None):
  """Draft scores of one tree level's children ([B, N] or [B, K, N]): the estimated log-probability
  that each is the target's token there. Greedy (`keys_B` None): the drafter's log-probs q.

  Sampling, the target's token will be `sampling.draw` with the level's key (`keys_B`, one per row,
  shared by its nodes), whose Gumbel noise is known now: the scores are the log-softmax of
  (log q + NOISE_WEIGHT * gaps) / (1 + NOISE_WEIGHT), gaps `sampling.gumbel_gaps` of q over the target's
  `vocab_size` tokens (a reduced head's mass at its `to_target` ids), a blend of q's ranking and the
  noise's that its measurement calibrates (the 1 + NOISE_WEIGHT). The child q's own draw with the key
  would give (gap 0) comes first, scored just above the level's best: a drafter whose q is the target's
  distribution is accepted as deep as the tree keeps those first children (a chain: every depth)."""
  if keys_B is None:
    return jax.nn.log_softmax(logits_BxN, axis=-1)
  logq = sampling.log_probs(logits_BxN, params)
  n = logq.shape[-1]
  ids = to_target(jnp.arange(n))
  if vocab_size in (None, n):
    gaps = sampling.gumbel_gaps(logq, keys_B)
  else:
    full = jnp.full(logq.shape[:-1] + (vocab_size,), -jnp.inf, logq.dtype).at[..., ids].set(logq)
    gaps = sampling.gumbel_gaps(full, keys_B)[..., ids]
  scores = jax.nn.log_softmax((logq + NOISE_WEIGHT * gaps) / (1 + NOISE_WEIGHT), axis=-1)
  return jnp.where(gaps == 0, jnp.nextafter(scores.max(-1, keepdims=True), jnp.inf), scores)


def draft_tree(draft_fn, logits_fn, draft_feat_BxH, root_B, cache: KVCache, strategy: Strategy,
               to_target=lambda ids: ids, params: SamplingParams | None = None, keys_BxD=None,
               vocab_size: int | None = None):
  """EAGLE-2 dynamic tree: expand the top-k frontier level by level, keep the best V-1 nodes.

  `draft_feat_BxH` is the drafter's output for the last committed pair (it predicts the root's
  feature); `draft_fn(cache, features_BxKxH, tokens_BxK, positions_BxK, mask_BxKxW)` runs the
  drafter on one frontier, writing the drafter cache past its lengths, and returns (predicted
  features, cache); `logits_fn` maps features to the drafter's vocabulary logits and `to_target`
  its token ids to the target's `vocab_size` ones (a reduced-vocabulary head, whose ids increase
  with the target's).
  Scores are cumulative estimated log-probabilities of acceptance (`level_scores`): greedy
  (`keys_BxD` None) the drafter's top-k; sampling, `keys_BxD` from `draft_keys` are the keys `accept`
  draws each depth's token with, whose noise ranks the children with q, and couples each level's
  first child to that draw, so a drafter whose distribution matches the target's is accepted as deep
  as the tree keeps first children, not with the probability of its most likely token. Returns the
  tree and the drafter cache (lengths unchanged).
  """
  lengths_B = cache.lengths
  k, depth, v = strategy.top_k, strategy.depth, strategy.verify_tokens
  b = root_B.shape[0]
  rows = jnp.arange(b)[:, None]
  key = (lambda d: None) if keys_BxD is None else (lambda d: keys_BxD[:, d - 1])
  score, token = jax.lax.top_k(level_scores(logits_fn(draft_feat_BxH), params, key(1), to_target, vocab_size), k)
  token = to_target(token)
  pool_token, pool_score = [token], [score]
  pool_parent, pool_depth = [jnp.full((b, k), -1)], [jnp.ones((b, k), jnp.int32)]
  frontier = jnp.broadcast_to(jnp.arange(k), (b, k))  # pool indices of the frontier
  feats = jnp.broadcast_to(draft_feat_BxH[:, None], (b, k, draft_feat_BxH.shape[-1]))
  window = (depth - 1) * k
  anc = jnp.zeros((b, k, max(window, 1)), bool)  # drafter-window slots of each frontier node's ancestors
  offset = k
  for d in range(2, depth + 1):
    slots = (d - 2) * k + jnp.arange(k)
    own = anc.at[:, jnp.arange(k), slots].set(True)
    out, cache = draft_fn(cache, feats, token, lengths_B[:, None] + d - 2 + jnp.zeros((b, k), jnp.int32),
                          own[:, :, :(d - 1) * k])
    child_score, child_token = jax.lax.top_k(level_scores(logits_fn(out), params, key(d), to_target, vocab_size), k)
    child_token = to_target(child_token)
    cum = (score[:, :, None] + child_score).reshape(b, k * k)
    pool_token.append(child_token.reshape(b, k * k))
    pool_score.append(cum)
    pool_parent.append(jnp.repeat(frontier, k, axis=1))
    pool_depth.append(jnp.full((b, k * k), d, jnp.int32))
    score, best = jax.lax.top_k(cum, k)
    parent = best // k
    frontier = offset + best
    token = child_token.reshape(b, k * k)[rows, best]
    feats = out[rows, parent]
    anc = own[rows, parent]
    offset += k * k
  tree = select_tree(root_B, jnp.concatenate(pool_token, 1), jnp.concatenate(pool_score, 1),
                     jnp.concatenate(pool_parent, 1), jnp.concatenate(pool_depth, 1), v, depth)
  return tree, cache


def select_tree(root_B, token_BxC, score_BxC, parent_BxC, depth_BxC, verify_tokens: int, depth: int) -> Tree:
  """The tree of the root and the best `verify_tokens - 1` of C candidate nodes (any drafter's).

  Candidate c holds `token_BxC` at `depth_BxC` below the root, under candidate `parent_BxC` (-1:
  the root). A parent must score at least its children and come first in the pool: ties go to
  the lower index, so a parent is always kept before its children and the kept set is a tree.
  A kept candidate scoring -inf (a drafter with fewer candidates than the strategy verifies)
  gets parent -1: no walk from the root reaches it, so it is verified but never accepted.
  """
  b, v = root_B.shape[0], verify_tokens
  rows = jnp.arange(b)[:, None]
  chosen = jnp.sort(jax.lax.top_k(score_BxC, v - 1)[1], axis=1)
  verify_index = jnp.full(score_BxC.shape, -1).at[rows, chosen].set(jnp.arange(1, v))
  parent_pool = parent_BxC[rows, chosen]
  parents = jnp.where(parent_pool < 0, 0, verify_index[rows, jnp.maximum(parent_pool, 0)])
  parents = jnp.where(score_BxC[rows, chosen] == -jnp.inf, -1, parents)
  parents = jnp.concatenate([jnp.full((b, 1), -1), parents], axis=1)
  depths = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), depth_BxC[rows, chosen]], axis=1)
  tokens = jnp.concatenate([root_B[:, None], token_BxC[rows, chosen]], axis=1).astype(jnp.int32)
  return Tree(tokens, parents, depths, ancestor_mask(parents, depth))


def root_only(root_B) -> Tree:
  """The one-node tree of plain decoding."""
  b = root_B.shape[0]
  zeros = jnp.zeros((b, 1), jnp.int32)
  return Tree(root_B[:, None].astype(jnp.int32), zeros - 1, zeros, jnp.ones((b, 1, 1), bool))


@flax.struct.dataclass
class Accepted:
  tokens: jax.Array  # [B, D+1] emitted tokens (first `count`)
  logprobs: jax.Array  # [B, D+1] their log-probs under the sampling distribution
  nodes: jax.Array  # [B, D+1] tree node whose target distribution produced each token
  count: jax.Array  # [B] tokens emitted (0 for inactive rows)
  stop: jax.Array  # [B] the last emitted token is a stop token
  length: jax.Array  # [B] the row's budget is used up


def accept(logits_BxVxN, tree: Tree, active_B, num_generated_B, max_new_B, prompt_index_B, sample_index_B,
           params: SamplingParams, max_depth: int) -> Accepted:
  """Walks the tree from the root, emitting one exact target sample per visited node."""
  b, v, _ = logits_BxVxN.shape
  rows = jnp.arange(b)
  logp = sampling.log_probs(logits_BxVxN, params)
  stop_ids = jnp.asarray(params.stop_token_ids, jnp.int32)
  node = jnp.zeros((b,), jnp.int32)
  alive, count = active_B, jnp.zeros((b,), jnp.int32)
  stopped, out_of_budget = jnp.zeros((b,), bool), jnp.zeros((b,), bool)
  tokens, logprobs, nodes = [], [], []
  for j in range(max_depth + 1):
    keys = sampling.row_keys(params.seed, prompt_index_B, sample_index_B, num_generated_B + j)
    x, lp = sampling.sample(logp[rows, node], keys, params)
    tokens.append(x)
    logprobs.append(lp)
    nodes.append(node)
    count = count + alive
    is_stop = alive & jnp.isin(x, stop_ids)
    is_length = alive & ~is_stop & (num_generated_B + j + 1 >= max_new_B)
    stopped, out_of_budget = stopped | is_stop, out_of_budget | is_length
    match = (tree.parents == node[:, None]) & (tree.tokens == x[:, None])
    alive = alive & ~is_stop & ~is_length & match.any(axis=1)
    node = jnp.where(match.any(axis=1), jnp.argmax(match, axis=1), node).astype(jnp.int32)
  return Accepted(jnp.stack(tokens, 1), jnp.stack(logprobs, 1), jnp.stack(nodes, 1), count, stopped, out_of_budget)


def commit(cache: KVCache, nodes_BxM, count_B) -> KVCache:
  """Moves the accepted path's keys/values from tree slots `lengths + nodes[j]` to `lengths + j`
  and advances the lengths by `count`; the other tree slots become garbage past the new length."""
  m = nodes_BxM.shape[1]
  j = jnp.arange(m)[None]
  src = cache.lengths[:, None] + jnp.where(j < count_B[:, None], nodes_BxM, j)
  dst = cache.lengths[:, None] + j
  at = lambda slots: layout.address(cache.pages, slots, cache.k.shape[2], cache.k.shape[1])
  (src_page, src_offset), (dst_page, dst_offset) = at(src), at(dst)
  # Gather the path, scatter it back: only these m slots move, never the whole cache.
  move = lambda kv: kv.at[:, dst_page, dst_offset].set(kv.at[:, src_page, src_offset].get(mode="clip"), mode="drop")
  return dataclasses.replace(cache, k=move(cache.k), v=move(cache.v), lengths=cache.lengths + count_B)
