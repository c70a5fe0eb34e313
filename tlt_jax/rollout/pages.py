"""The host's bookkeeping of a paged KV cache: which pages of the pool each row holds.

A row's page table lists its pages in slot order: first its prompt's shared pages, then its own.
The samples of one prompt share the prompt's full pages before the one that holds its last token
(that page also takes each row's own first drafter pair and generated tokens, so every row has
its own copy), freed when the last row holding them lets go. A row's own pages are
taken as it grows (the engine plans each play's writes at the play's start) and all given back
when it finishes or is preempted.

Split into shards (pages split like rows over several devices, for the attention kernels that
run per device): shard s owns the pool's s-th equal range of pages, a row takes every page from
the shard it was admitted to, and a prompt's samples on different shards share a copy per shard.
"""

from __future__ import annotations

import numpy as np


class Pages:
  """Free pages, each prompt's shared pages and their holders, and every row's own pages (rows keyed
  by the caller's row index), per shard of the pool."""

  def __init__(self, num_pages: int, page_size: int, pages_per_row: int, shards: int = 1):
    if num_pages % shards:
      raise ValueError(f"{num_pages} pages do not split into {shards} equal shards")
    self.num_pages, self.page_size, self.pages_per_row, self.shards = num_pages, page_size, pages_per_row, shards
    per = num_pages // shards
    # Stacks: the lowest page of a shard is taken first.
    self._free = [list(range((s + 1) * per - 1, s * per - 1, -1)) for s in range(shards)]
    self._shared: dict[tuple[int, int], tuple[list[int], int]] = {}  # (prompt, shard) -> (shared pages, holders)
    self._rows: dict[int, tuple[int, int, list[int]]] = {}  # row -> (prompt, shard, its own pages)

  @property
  def free(self) -> int:
    return sum(map(len, self._free))

  def free_on(self, shard: int) -> int:
    return len(self._free[shard])

  @property
  def held(self) -> int:
    return self.num_pages - self.free

  @property
  def rows(self) -> int:
    """Rows holding pages."""
    return len(self._rows)

  def rows_on(self, shard: int) -> int:
    return sum(s == shard for _, s, _ in self._rows.values())

  def shard(self, row: int) -> int:
    """The shard `row`'s pages lie on."""
    return self._rows[row][1]

  def shared_slots(self, prompt_len: int) -> int:
    """Prompt slots in shared pages: the full pages before the one holding the last prompt token."""
    return (prompt_len - 1) // self.page_size * self.page_size

  def _own_pages(self, prompt_len: int, slots: int) -> int:
    """Pages of its own a row needs to hold `slots` slots (at most its capacity)."""
    total = -(-min(slots, self.pages_per_row * self.page_size) // self.page_size)
    return max(0, total - self.shared_slots(prompt_len) // self.page_size)

  def fits(self, prompt: int, prompt_len: int, slots: int, reserve: int = 0, shard: int = 0) -> bool:
    """A row of `prompt` holding `slots` slots fits in the free pages of `shard`, leaving `reserve`
    free."""
    new_shared = 0 if (prompt, shard) in self._shared else self.shared_slots(prompt_len) // self.page_size
    return new_shared + self._own_pages(prompt_len, slots) + reserve <= self.free_on(shard)

  def admit(self, row: int, prompt: int, prompt_len: int, slots: int, reserve: int = 0, shard: int = 0) -> int | None:
    """Gives `row` (a sample of `prompt`) the prompt's shared pages and its own up to `slots` slots,
    on `shard`.

    Returns the prompt slot its prefill writes from: 0 when the shared pages are new (it writes
    them), else where its own pages start; None (nothing taken) when the shard lacks the pages or
    taking them would leave fewer than `reserve` free.
    """
    if not self.fits(prompt, prompt_len, slots, reserve, shard):
      return None
    key = (prompt, shard)
    fresh = key not in self._shared
    shared, holders = self._shared.get(key) or (self._take(shard, self.shared_slots(prompt_len) // self.page_size), 0)
    self._shared[key] = (shared, holders + 1)
    self._rows[row] = (prompt, shard, self._take(shard, self._own_pages(prompt_len, slots)))
    return 0 if fresh else self.shared_slots(prompt_len)

  def missing(self, row: int, prompt_len: int, slots: int) -> int:
    """Pages `row` lacks to hold `slots` slots."""
    return max(0, self._own_pages(prompt_len, slots) - len(self._rows[row][2]))

  def grow(self, row: int, prompt_len: int, slots: int) -> None:
    """Takes the pages `row` lacks to hold `slots` slots, from its shard (the caller checked
    `missing` fits)."""
    _, shard, own = self._rows[row]
    own.extend(self._take(shard, self.missing(row, prompt_len, slots)))

  def release(self, row: int) -> None:
    """Gives back the row's own pages and its reference to its prompt's shared pages."""
    prompt, shard, own = self._rows.pop(row)
    self._give(shard, own)
    shared, holders = self._shared.pop((prompt, shard))
    if holders > 1:
      self._shared[(prompt, shard)] = (shared, holders - 1)
    else:
      self._give(shard, shared)

  def holds(self, row: int) -> bool:
    return row in self._rows

  def table(self, slot_rows) -> np.ndarray:
    """int32 [B, pages_per_row]: each slot's row's pages in slot order; `num_pages` (no page) past
    them and for slots whose entry is -1 or a row that holds none."""
    out = np.full((len(slot_rows), self.pages_per_row), self.num_pages, np.int32)
    for b, row in enumerate(slot_rows):
      if row >= 0 and row in self._rows:
        prompt, shard, own = self._rows[row]
        held = self._shared[(prompt, shard)][0] + own
        out[b, :len(held)] = held
    return out

  def _take(self, shard: int, n: int) -> list[int]:
    return [self._free[shard].pop() for _ in range(n)]

  def _give(self, shard: int, pages: list[int]) -> None:
    self._free[shard].extend(reversed(pages))
