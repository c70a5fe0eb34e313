"""The engine's scheduling decisions on the host, without compiling anything: admission (with the
pool's pages and its headroom), refills by chunks, compaction that keeps each row on its device,
preemption of the row with the fewest tokens and its return, where a play stops."""

import numpy as np
import pytest

from tlt_jax.rollout.schedule import Schedule, bucket_for
from tlt_jax.rollout.speculative import Strategy
from tlt_jax.rollout.state import EngineConfig

# Prompts of 20 tokens: one shared page of 16 slots, the last prompt token on a row's own page.
PROMPT_LEN = 20


def _config(**kw) -> EngineConfig:
  return EngineConfig(**{"batch_buckets": (1, 2, 4, 8), "max_prompt_len": 32, "max_new_tokens": 32,
                         "segment_steps": 4, "kv_block": 16, "sd_max_batch": 2, **kw})


def _schedule(config: EngineConfig, prompts, shards: int = 1) -> Schedule:
  """One row per entry of `prompts` (its prompt index; a prompt's rows are its samples)."""
  rows = [(p, sum(q == p for q in prompts[:i])) for i, p in enumerate(prompts)]
  return Schedule(config, rows, [PROMPT_LEN] * len(rows), [32] * len(rows), shards)


def _play(sched: Schedule, done, generated) -> None:
  sched.observe(np.asarray(done, bool), np.asarray(generated, np.int32))
  sched.release_finished()


def test_the_bucket_holds_the_rows_and_one_per_device():
  c = _config()
  assert [bucket_for(c, n) for n in (1, 3, 8)] == [1, 4, 8] and bucket_for(c, 1, shards=4) == 4


def test_rows_enter_in_order_and_refill_by_chunks():
  sched = _schedule(_config(), list(range(11)))
  assert sched.bucket == 8 and sched.config.refill_chunk == 2
  new, write_from = sched.admit(range(8))
  assert new.tolist() == list(range(8)) and not write_from.any() and list(sched.waiting) == [8, 9, 10]
  _play(sched, [0] * 8, [5] * 8)
  assert not sched.refill_ready() and sched.stop_at(before_tail=False) == 6  # once 2 slots are free
  _play(sched, [0, 1, 0, 0, 0, 0, 0, 0], [5] * 8)
  assert not sched.refill_ready()  # one free slot: not a chunk yet
  _play(sched, [0, 1, 0, 0, 0, 1, 0, 0], [5] * 8)
  assert sched.refill_ready()
  new, _ = sched.admit(np.flatnonzero(sched.done))
  assert new.tolist() == [-1, 8, -1, -1, -1, 9, -1, -1] and list(sched.waiting) == [10]
  _play(sched, [0, 0, 0, 1, 0, 0, 0, 0], [5] * 8)
  assert sched.refill_ready()  # the last waiting row is a whole chunk
  sched.admit([3])
  assert not sched.waiting and not sched.finished and sched.stop_at(before_tail=False) == 4  # then compaction


def test_the_tail_compacts_into_the_smallest_bucket_that_holds_it():
  sched = _schedule(_config(), list(range(8)))
  sched.admit(range(8))
  _play(sched, [1, 1, 1, 0, 1, 1, 1, 1], [5, 5, 5, 7, 5, 5, 5, 5])
  assert sched.compactable()
  keeps = sched.compact()
  assert [k.tolist() for k in keeps] == [[3, -1, -1, -1], [0, -1], [0]]
  assert sched.bucket == 1 and sched.slot_row.tolist() == [3] and sched.generated.tolist() == [7]
  assert sched.stop_at(before_tail=False) == 0 and not sched.compactable()


def test_without_compaction_the_play_runs_to_the_end_or_the_bandits_turn():
  sched = _schedule(_config(compact=False), list(range(8)))
  sched.admit(range(8))
  _play(sched, [1, 1, 1, 0, 1, 1, 1, 0], [5] * 8)
  assert not sched.compactable() and sched.stop_at(before_tail=False) == 0
  assert sched.stop_at(before_tail=True) == 2  # sd_max_batch


def test_admission_leaves_each_row_in_flight_a_plays_growth():
  # 6 pages: a row of a new prompt takes 2 (the shared one and its own); the second leaves the
  # first one page to grow, the third would leave the two in flight one page between them.
  sched = _schedule(_config(page_size=16, num_pages=6), [0, 1, 2, 3])
  new, write_from = sched.admit(range(4))
  assert new.tolist() == [0, 1, -1, -1] and write_from.tolist() == [0, 0, 0, 0]
  assert sched.pages.free == 2 and list(sched.waiting) == [2, 3]
  _play(sched, [0, 0, 1, 1], [1, 1, 0, 0])
  assert not sched.refill_ready() and sched.blocked and sched.stop_at(before_tail=False) == 1  # a row's end
  _play(sched, [1, 0, 1, 1], [3, 1, 0, 0])  # row 0 gives its 2 pages back
  assert sched.refill_ready() and not sched.blocked


def test_a_prompts_later_sample_prefills_its_prompts_tail_after_a_siblings_shared_page():
  sched = _schedule(_config(page_size=16), [0, 0, 0, 1])
  new, write_from = sched.admit([0])
  whole, tails, back = sched.prefills(new, write_from)
  assert whole.tolist()[:1] == [0] and not tails and not back
  _play(sched, [0, 1, 1, 1], [2, 0, 0, 0])
  new, write_from = sched.admit([1, 2, 3])
  assert new.tolist() == [-1, 1, 2, 3] and write_from.tolist() == [0, 16, 16, 0]
  whole, tails, back = sched.prefills(new, write_from)
  assert whole.tolist() == [-1, -1, -1, 3] and tails == [(1, 16, 0), (2, 16, 0)] and not back
  # Samples entering together with their prompt's first one prefill whole (the shared page is written then).
  fresh = _schedule(_config(page_size=16), [0, 0])
  new, write_from = fresh.admit(range(2))
  assert write_from.tolist() == [0, 16] and fresh.prefills(new, write_from)[0].tolist() == [0, 1]


def test_a_short_pool_preempts_the_row_with_the_fewest_tokens_and_it_comes_back_with_them():
  # 7 pages, 2 rows of 2 (a shared page and one of its own): 3 free. A plain play of 4 steps from
  # 26 generated tokens fills 49 slots: 4 pages, 2 more each, so one row must go.
  c = _config(page_size=16, num_pages=7)
  sched = _schedule(c, [0, 1])
  sched.admit(range(2))
  assert sched.pages.free == 3
  _play(sched, [0, 0], [20, 20])
  assert sched.victim(None) is None  # 43 slots: 3 pages, 1 more each
  _play(sched, [0, 0], [26, 30])
  assert sched.victim(None) == 0  # the fewest tokens
  _play(sched, [0, 0], [26, 26])
  assert sched.victim(None) == 1  # of rows as far along, the latest in
  tokens, logprobs = np.arange(26), np.zeros(26, np.float32)
  sched.preempt(1, tokens, logprobs)
  assert list(sched.waiting) == [1] and sched.slot_row.tolist() == [0, -1] and sched.pages.rows == 1
  assert sched.victim(None) is None
  sched.reserve(None)
  assert sched.pages.missing(0, PROMPT_LEN, 49) == 0
  # A speculative play writes more: 4 x (2 + 1) + its window past the length.
  strategy = Strategy(depth=2, top_k=2, verify_tokens=4)
  assert c.play_slots(strategy) == 4 * 3 + strategy.window
  _play(sched, [1, 1], [32, 26])
  assert sched.refill_ready()
  new, write_from = sched.admit([0, 1])
  assert new.tolist() == [1, -1]
  _, _, back = sched.prefills(new, write_from)
  assert len(back) == 1 and back[0][0] == 0 and back[0][1] is tokens and not sched.kept


def test_a_single_row_that_cannot_grow_is_an_error():
  sched = _schedule(_config(page_size=16, num_pages=5), [0])
  sched.admit([0])
  sched.pages._free[0].clear()  # what a pool too small for one row would come to
  _play(sched, [0], [10])
  with pytest.raises(RuntimeError, match="cannot hold the rows of bucket 1"):
    sched.victim(None)


def test_compaction_keeps_every_row_on_its_device():
  c = _config(page_size=16)  # 8 rows' pages, 4 per device
  sched = _schedule(c, list(range(8)), shards=2)
  sched.admit(range(8))
  assert [sched.pages.shard(r) for r in range(8)] == [0] * 4 + [1] * 4
  _play(sched, [0, 1, 1, 1, 0, 0, 0, 1], [3] * 8)  # device 1 holds 3 active rows: more than half its slots
  assert not sched.compactable() and sched.blocked and sched.stop_at(before_tail=False) == 3
  _play(sched, [0, 1, 1, 1, 1, 0, 0, 1], [3] * 8)
  assert sched.compactable()
  assert [k.tolist() for k in sched.compact()] == [[0, -1, 5, 6]]
  assert sched.bucket == 4 and sched.slot_row.tolist() == [0, -1, 5, 6]  # bucket_for(3 rows, 2 devices)
