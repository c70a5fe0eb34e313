"""Suffix drafting: the bank's layout, each row's context, and the draft tree of bank matches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tlt_jax.rollout import speculative, suffix
from tlt_jax.rollout.speculative import Strategy

jit_draft_tree = jax.jit(suffix.draft_tree, static_argnums=3)
E = -1  # an empty bank slot


def paths(tree, r):
  """Row r's tree as {node: token path from the root}; nodes no walk reaches are left out."""
  tokens, parents = np.asarray(tree.tokens[r]), np.asarray(tree.parents[r])
  out = {0: ()}
  for i in range(1, len(tokens)):
    if parents[i] in out:
      assert 0 <= parents[i] < i
      out[i] = out[parents[i]] + (int(tokens[i]),)
    else:
      assert parents[i] == -1
  return out


def drafted(bank, context, name):
  """The set of token paths drafted for one row."""
  tree = jit_draft_tree(jnp.asarray([bank], jnp.int32), jnp.asarray([context], jnp.int32),
                        jnp.asarray([context[-1]], jnp.int32), Strategy.parse(name))
  return set(paths(tree, 0).values()) - {()}


def test_one_match_drafts_a_chain_of_what_followed():
  bank = [E, 5, 6, 7, 8, 9, 4, E, E]
  assert drafted(bank, [6, 7], "s3_1_4") == {(8,), (8, 9), (8, 9, 4)}
  assert drafted(bank, [6, 7], "s3_1_3") == {(8,), (8, 9)}  # cut to the verify budget
  assert drafted(bank, [5, 6, 7], "s6_1_7") == {(8,), (8, 9), (8, 9, 4)}  # cut at the empty slot
  assert drafted(bank, [1, 2], "s3_1_4") == set()  # no match: nothing reachable


def test_longest_match_first_then_latest():
  # "3 6 7" then 8 (l = 3); "6 7" then 1 and later 2 (l = 2); "7" then 9 (l = 1).
  bank = [3, 6, 7, 8, E, 6, 7, 1, E, 6, 7, 2, E, 7, 9, E]
  assert drafted(bank, [3, 6, 7], "s1_1_2") == {(8,)}
  assert drafted(bank, [3, 6, 7], "s1_2_3") == {(8,), (2,)}
  assert drafted(bank, [3, 6, 7], "s1_4_5") == {(8,), (2,), (1,), (9,)}
  assert drafted(bank, [0, 6, 7], "s1_1_2") == {(2,)}  # no l = 3 match: the latest l = 2 one
  assert drafted(bank, [5, 5, 5, 7], "s1_4_3") == {(9,), (2,)}  # every match l = 1: the latest two


def test_a_longer_continuation_ranks_before_a_later_match():
  # A row repeating itself ("4 4 4 4", the last 4 its root): its latest match (position 7) is right
  # before its root, one token to propose; the one before (position 6) proposes two.
  bank = [4, 4, 4, 5, E, 4, 4, 4, 4, E]
  assert drafted(bank, [4, 4], "s3_1_4") == {(4,), (4, 4)}
  assert drafted(bank, [4, 4], "s1_1_2") == {(4,)}


def test_matches_that_agree_merge_and_the_most_shared_prefix_ranks_first():
  # After "6 7": "8 9 1", "8 9 2", "8 3", "4" (latest first: 4, then 8 3, then 8 9 2, then 8 9 1).
  bank = [6, 7, 8, 9, 1, E, 6, 7, 8, 9, 2, E, 6, 7, 8, 3, E, 6, 7, 4, E]
  assert drafted(bank, [6, 7], "s3_4_10") == {(4,), (8,), (8, 3), (8, 9), (8, 9, 2), (8, 9, 1)}
  # Budget 3: "8" (3 matches share it), "8 9" (2), then the latest of the rest at count 1: "4".
  assert drafted(bank, [6, 7], "s3_4_4") == {(8,), (8, 9), (4,)}
  assert drafted(bank, [6, 7], "s3_2_7") == {(8,), (8, 9), (8, 9, 2), (8, 9, 1)}  # the two longest continuations
  assert drafted(bank, [6, 7], "s1_2_3") == {(4,), (8,)}  # depth 1: every continuation is long enough


def reference(bank, context, strategy):
  """The drafted paths by hand: matches ranked (longest, latest), their continuations' trie, the
  best verify_tokens - 1 nodes by (matches sharing it, their longest l, shallower, earlier rank)."""
  n, length = len(context), len(bank)
  matches = []
  for i in range(length - 1):
    l = 0
    while l < n and i - l >= 0 and context[n - 1 - l] >= 0 and bank[i - l] == context[n - 1 - l]:
      l += 1
    follow = 0
    while follow < strategy.depth and i + 1 + follow < length and bank[i + 1 + follow] >= 0:
      follow += 1
    if l and follow:
      matches.append((l, follow, i))
  matches = sorted(matches, reverse=True)[:strategy.top_k]
  nodes = {}  # prefix -> [count, longest, depth, rank of its first match]
  for rank, (l, _, i) in enumerate(matches):
    cont = []
    for t in bank[i + 1:i + 1 + strategy.depth]:
      if t < 0:
        break
      cont.append(t)
      node = nodes.setdefault(tuple(cont), [0, 0, len(cont), rank])
      node[0] += 1
      node[1] = max(node[1], l)
  ranked = sorted(nodes, key=lambda p: (-nodes[p][0], -nodes[p][1], nodes[p][2], nodes[p][3]))
  return set(ranked[:strategy.verify_tokens - 1])


@settings(max_examples=60)
@given(st.sampled_from(["s4_3_8", "s2_1_3", "s3_4_13", "s5_2_4"]),
       hnp.arrays(np.int32, (3, 40), elements=st.integers(-1, 3)),
       hnp.arrays(np.int32, (3, 4), elements=st.integers(-1, 3)))
def test_fuzz_the_tree_is_the_reference_trie(name, bank, context):
  """Small alphabets: many matches, ties and merges; every row's tree is valid and the reference's."""
  strategy = Strategy.parse(name)
  root = np.maximum(context[:, -1], 0)
  tree = jit_draft_tree(jnp.asarray(bank), jnp.asarray(context), jnp.asarray(root), strategy)
  np.testing.assert_array_equal(tree.tokens[:, 0], root)
  np.testing.assert_array_equal(tree.mask, speculative.ancestor_mask(tree.parents, strategy.depth))
  for r in range(3):
    found = paths(tree, r)
    assert len(set(found.values())) == len(found)  # siblings are distinct tokens
    for i, path in found.items():
      assert tree.depths[r, i] == len(path) <= strategy.depth
    assert set(found.values()) - {()} == reference(bank[r].tolist(), context[r].tolist(), strategy)


def test_layout_and_context():
  layout = suffix.Layout(bank_len=40, max_prompt_len=8, num_samples=3, max_new_tokens=100)
  assert (layout.region, layout.room, layout.offset(0), layout.offset(2)) == (10, 9, 8, 28)
  short = suffix.Layout(bank_len=40, max_prompt_len=8, num_samples=3, max_new_tokens=4)
  assert (short.region, short.room, short.offset(1)) == (5, 4, 13)
  assert suffix.Layout(bank_len=9, max_prompt_len=8, num_samples=2, max_new_tokens=4).room == 0  # the prompt only
  bank = np.full((2, 20), -1, np.int32)
  bank[:, 5:8] = [11, 12, 13]  # a 3-token prompt, right-aligned to 8
  tokens = np.asarray([[21, 22, 23, 24, 0, 0], [21, 0, 0, 0, 0, 0]], np.int32)
  got = suffix.context(jnp.asarray(bank), jnp.asarray(tokens), jnp.asarray([4, 1]), 8, 5)
  np.testing.assert_array_equal(got, [[13, 21, 22, 23, 24], [-1, 11, 12, 13, 21]])


def test_history_sizes_regions_and_keeps_the_latest_epochs():
  layout = suffix.Layout(bank_len=40, max_prompt_len=8, num_samples=3, max_new_tokens=100, history_len=12)
  assert (layout.region, layout.offset(2)) == (6, 20)  # 40 - 8 - 12 = 20 slots for 3 samples
  history = suffix.History(length=12, ngram=2)
  prompt = [7, 8, 9]
  assert history.get(prompt).tolist() == [] and len(history) == 0
  history.add(prompt, [[1, 2], [3]])
  assert history.get(prompt).tolist() == [8, 9, 1, 2, -1, 8, 9, 3, -1]
  history.add(prompt, [[4, 5, 6]])  # the newer epoch first; the oldest tokens dropped past 12
  assert history.get(prompt).tolist() == [8, 9, 4, 5, 6, -1, 8, 9, 1, 2, -1, 8]
  history.add([1], [[2]])
  restored = suffix.History(length=12, ngram=2)
  restored.load_state_dict(history.state_dict())
  assert len(restored) == 2
  for p in (prompt, [1]):
    assert restored.get(p).tolist() == history.get(p).tolist()


@pytest.mark.parametrize("name", ["s4_1_6", "s2_3_8", "s0_1_2", "sx_1_2", "s4_1"])
def test_bad_suffix_strategy_rejected(name):
  with pytest.raises(ValueError, match=name):
    Strategy.parse(name)
