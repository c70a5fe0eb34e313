"""The host's bookkeeping of a paged KV cache: which pages of the pool each row holds.

A row's page table lists its pages in slot order: first its prompt's shared pages, then its own.
The samples of one prompt share the prompt's full pages before the one that holds its last token
(that page also takes each row's own first drafter pair and generated tokens, so every row has
its own copy), freed when the last row holding them lets go. A row's own pages are
taken as it grows (the engine plans each play's writes at the play's start) and all given back
when it finishes or is preempted.
"""

from __future__ import annotations

import numpy as np


class Pages:
  """Free pages, each prompt's shared pages and their holders, and every row's own pages (rows keyed
  by the caller's row index)."""

  def __init__(self, num_pages: int, page_size: int, pages_per_row: int):
    self.num_pages, self.page_size, self.pages_per_row = num_pages, page_size, pages_per_row
    self._free = list(range(num_pages - 1, -1, -1))  # a stack: the lowest page is taken first
    self._shared: dict[int, tuple[list[int], int]] = {}  # prompt -> (its shared pages, rows holding them)
    self._rows: dict[int, tuple[int, list[int]]] = {}  # row -> (prompt, its own pages)

  @property
  def free(self) -> int:
    return len(self._free)

  @property
  def held(self) -> int:
    return self.num_pages - self.free

  @property
  def rows(self) -> int:
    """Rows holding pages."""
    return len(self._rows)

  def shared_slots(self, prompt_len: int) -> int:
    """Prompt slots in shared pages: the full pages before the one holding the last prompt token."""
    return (prompt_len - 1) // self.page_size * self.page_size

  def _own_pages(self, prompt_len: int, slots: int) -> int:
    """Pages of its own a row needs to hold `slots` slots (at most its capacity)."""
    total = -(-min(slots, self.pages_per_row * self.page_size) // self.page_size)
    return max(0, total - self.shared_slots(prompt_len) // self.page_size)

  def fits(self, prompt: int, prompt_len: int, slots: int, reserve: int = 0) -> bool:
    """A row of `prompt` holding `slots` slots fits in the free pages, leaving `reserve` free."""
    new_shared = 0 if prompt in self._shared else self.shared_slots(prompt_len) // self.page_size
    return new_shared + self._own_pages(prompt_len, slots) + reserve <= self.free

  def admit(self, row: int, prompt: int, prompt_len: int, slots: int, reserve: int = 0) -> int | None:
    """Gives `row` (a sample of `prompt`) the prompt's shared pages and its own up to `slots` slots.

    Returns the prompt slot its prefill writes from: 0 when the shared pages are new (it writes
    them), else where its own pages start; None (nothing taken) when the pool lacks the pages or
    taking them would leave fewer than `reserve` free.
    """
    if not self.fits(prompt, prompt_len, slots, reserve):
      return None
    fresh = prompt not in self._shared
    shared, holders = self._shared.get(prompt) or (self._take(self.shared_slots(prompt_len) // self.page_size), 0)
    self._shared[prompt] = (shared, holders + 1)
    self._rows[row] = (prompt, self._take(self._own_pages(prompt_len, slots)))
    return 0 if fresh else self.shared_slots(prompt_len)

  def missing(self, row: int, prompt_len: int, slots: int) -> int:
    """Pages `row` lacks to hold `slots` slots."""
    return max(0, self._own_pages(prompt_len, slots) - len(self._rows[row][1]))

  def grow(self, row: int, prompt_len: int, slots: int) -> None:
    """Takes the pages `row` lacks to hold `slots` slots (the caller checked `missing` fits)."""
    self._rows[row][1].extend(self._take(self.missing(row, prompt_len, slots)))

  def release(self, row: int) -> None:
    """Gives back the row's own pages and its reference to its prompt's shared pages."""
    prompt, own = self._rows.pop(row)
    self._give(own)
    shared, holders = self._shared.pop(prompt)
    if holders > 1:
      self._shared[prompt] = (shared, holders - 1)
    else:
      self._give(shared)

  def holds(self, row: int) -> bool:
    return row in self._rows

  def table(self, slot_rows) -> np.ndarray:
    """int32 [B, pages_per_row]: each slot's row's pages in slot order; `num_pages` (no page) past
    them and for slots whose entry is -1 or a row that holds none."""
    out = np.full((len(slot_rows), self.pages_per_row), self.num_pages, np.int32)
    for b, row in enumerate(slot_rows):
      if row >= 0 and row in self._rows:
        prompt, own = self._rows[row]
        held = self._shared[prompt][0] + own
        out[b, :len(held)] = held
    return out

  def _take(self, n: int) -> list[int]:
    return [self._free.pop() for _ in range(n)]

  def _give(self, pages: list[int]) -> None:
    self._free.extend(reversed(pages))
