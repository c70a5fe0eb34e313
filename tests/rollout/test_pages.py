"""The host's page bookkeeping: shared prompt pages, growth, release and tables."""

import numpy as np
import pytest

from tlt_jax.rollout.pages import Pages


def test_samples_of_a_prompt_share_its_full_pages():
  pages = Pages(num_pages=12, page_size=4, pages_per_row=5)
  assert pages.shared_slots(9) == 8 and pages.shared_slots(8) == 4 and pages.shared_slots(4) == 0
  # A 9-token prompt: slots 0-7 in two shared pages, slot 8 (its last token) in each row's own page.
  assert pages.admit(row=0, prompt=7, prompt_len=9, slots=10) == 0  # the first writes the shared pages
  assert pages.free == 12 - 2 - 1
  assert pages.admit(row=1, prompt=7, prompt_len=9, slots=10) == 8  # the next starts past them
  assert pages.free == 12 - 2 - 2
  table = pages.table([1, -1, 0])
  np.testing.assert_array_equal(table[0, :2], table[2, :2])  # shared
  assert table[0, 2] != table[2, 2] and (table[1] == 12).all() and (table[:, 3:] == 12).all()
  pages.release(0)
  assert pages.free == 12 - 2 - 1 and not pages.holds(0)
  pages.release(1)
  assert pages.free == 12  # the last holder frees the shared pages
  assert pages.admit(row=2, prompt=7, prompt_len=9, slots=9) == 0  # a new holder writes them again


def test_rows_grow_to_their_capacity_and_admission_waits_for_pages():
  pages = Pages(num_pages=6, page_size=4, pages_per_row=3)
  assert pages.admit(0, prompt=0, prompt_len=3, slots=4) == 0 and pages.free == 5
  assert pages.missing(0, 3, 9) == 2 and pages.missing(0, 3, 100) == 2  # capped at the row's 3 pages
  pages.grow(0, 3, 9)
  assert pages.free == 3 and (pages.table([0])[0] < 6).all()
  assert pages.fits(1, 5, 12) and pages.fits(1, 5, 100)  # 1 shared + 2 own: a row's 3 pages at most
  assert pages.admit(1, prompt=1, prompt_len=5, slots=12) == 0 and pages.free == 0  # shared 1 + own 2
  assert not pages.fits(2, 1, 1) and pages.admit(2, prompt=2, prompt_len=1, slots=1) is None
  assert not pages.holds(2)  # nothing taken
  assert pages.admit(3, prompt=1, prompt_len=5, slots=5) is None  # its prompt's page is held, its own is not free
  pages.release(0)
  assert pages.admit(3, prompt=1, prompt_len=5, slots=5) == 4 and pages.free == 2
  held = pages.table([1, 3])
  assert len(set(held[held < 6].tolist())) == 4  # 1 shared + 2 + 1 own, no page twice


def test_a_pool_split_into_shards_keeps_each_row_on_its_shard():
  """Pages split like rows over devices: a row takes every page from its shard's range, and a
  prompt's samples on two shards share a copy per shard."""
  pages = Pages(num_pages=8, page_size=4, pages_per_row=3, shards=2)
  assert pages.admit(0, prompt=0, prompt_len=9, slots=10, shard=1) == 0  # 2 shared + 1 own, on pages 4-7
  assert pages.free_on(1) == 1 and pages.free_on(0) == 4 and pages.shard(0) == 1
  assert pages.admit(1, prompt=0, prompt_len=9, slots=10, shard=1) == 8  # its sibling shares them
  assert pages.admit(2, prompt=0, prompt_len=9, slots=10, shard=0) == 0  # another shard: its own copy
  assert not pages.fits(0, 9, 10, shard=1) and pages.fits(0, 9, 10, shard=0)
  table = pages.table([0, 1, 2])
  assert set(table[:2].ravel()) <= {4, 5, 6, 7} and set(table[2, :3]) <= {0, 1, 2, 3}
  np.testing.assert_array_equal(table[0, :2], table[1, :2])
  assert not set(table[2, :2]) & set(table[0, :2])
  assert pages.rows_on(1) == 2 and pages.rows_on(0) == 1
  pages.release(0)
  pages.release(1)
  assert pages.free_on(1) == 4 and pages.free_on(0) == 1  # shard 0's copy stays with its holder
  with pytest.raises(ValueError, match="9 pages do not split into 2 equal shards"):
    Pages(num_pages=9, page_size=4, pages_per_row=3, shards=2)
