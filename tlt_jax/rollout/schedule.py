"""The engine's host-side scheduling: which row each slot holds and what the next play may do.

`Engine._run` (tlt_jax/rollout/engine.py) alternates device work (prefill, a play of segments,
compaction) with decisions the host takes between them; `Schedule` holds those decisions and the
state they read, in NumPy and `Pages` only, so they are tested without compiling anything.

The batch takes the first rows that fit the largest bucket (and, paged, the pool). While rows
wait, it stays at that bucket: once `refill_chunk` of its slots are free (or every waiting row
fits) the play ends on the device, the finished rows are harvested and waiting rows are
prefilled into their slots. Each refill pays one sync and a fixed-shape prefill whatever the
rows it brings, so waiting for a chunk amortises it while keeping the batch at least 3/4 full
(default chunk: a quarter). Once nothing waits, the tail compacts into smaller buckets and may
speculate.

Paged: a row enters once the pool has its pages (its prompt's shared pages are taken by the
first of its samples in flight), finished rows give theirs back at once, and before each play
every active row takes the pages the play may write; a row enters only if the rows in flight
keep a play's growth each. When the pool runs short, the rows with the fewest tokens are
preempted: their pages freed, their tokens kept on the host, back to the front of the queue;
when a row comes back, its prompt and its tokens are prefilled again (`Steps.resume`) and it
goes on where it stopped. A row waiting for its tools (`held`, `tlt_jax.rollout.tools`) keeps its
slot and pages: it counts as active, is never preempted, and takes the pages of the tokens its
tool turn appends before they are written (`take_turn`). The tail compacts only once the pool
holds every active row to its budget, so a smaller bucket never preempts. With the pool split over devices (`shards`), a
slot's row takes pages on the slot's device: admission, preemption and that check count pages
per device, and compaction keeps every row on its device.
"""

from __future__ import annotations

import collections
import itertools
from typing import Sequence

import numpy as np

from tlt_jax.rollout.pages import Pages
from tlt_jax.rollout.speculative import Strategy
from tlt_jax.rollout.state import EngineConfig


def bucket_for(config: EngineConfig, rows: int, shards: int = 1) -> int:
  """The batch bucket that holds `rows` rows: the config's, and with a pool split over `shards`
  devices at least one row per device."""
  return max(config.bucket(rows), shards)


class Schedule:
  """The host's view of one run of rows through the slots of a batch bucket.

  Attributes:
    rows: (prompt index, sample index) per row, in order of entry; rows are named by their index here.
    bucket: the slots now (halved by compaction); `entry_bucket`: the one rows enter at.
    slot_row: int [bucket], the row each slot holds (-1: none; a finished row stays until replaced).
    done, generated: the device's per-slot counters as last observed (`observe`).
    waiting: rows not in a slot, next first (preempted rows come back first).
    kept: a preempted row's tokens and log-probs, prefilled again when it comes back.
    pages: the paged cache's bookkeeping (None: contiguous caches).
    blocked: rows wait for pages (to enter, or for the tail to compact), not for slots; set by
      `refill_ready` and `compactable`, read by `stop_at`.
    held: rows waiting for their tools: active here, done on the device (the engine keeps it).
  """

  def __init__(self, config: EngineConfig, rows: Sequence[tuple[int, int]], prompt_lens: Sequence[int],
               budgets: Sequence[int], shards: int = 1):
    """`prompt_lens`, `budgets` (new tokens at most): per row; `shards`: the devices the page pool
    splits over (1: one range)."""
    self.config, self.rows, self.prompt_lens, self.budgets, self.shards = config, rows, prompt_lens, budgets, shards
    self.bucket = self.entry_bucket = bucket_for(config, min(len(rows), config.batch_buckets[-1]), shards)
    self.pages = Pages(config.pool_pages, config.page_size, config.pages_per_row, shards) if config.paged else None
    self.waiting = collections.deque(range(len(rows)))
    self.slot_row = np.full((self.bucket,), -1)
    self.entered = np.zeros((self.bucket,), np.int64)  # of rows as far along, preemption takes the latest
    self.kept: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    self.done = np.ones((self.bucket,), bool)
    self.generated = np.zeros((self.bucket,), np.int32)
    self.blocked = False
    self.held: set[int] = set()
    self._clock = itertools.count()

  @property
  def active(self) -> int:
    return int((~self.done).sum())

  @property
  def finished(self) -> bool:
    return not self.waiting and bool(self.done.all())

  def observe(self, done: np.ndarray, generated: np.ndarray) -> None:
    """Takes the device's counters after a sync."""
    self.done, self.generated = np.array(done, bool), np.array(generated, np.int32)

  def table(self) -> np.ndarray | None:
    """The page tables of the slots' rows (None: contiguous caches)."""
    return None if self.pages is None else self.pages.table(self.slot_row)

  def _shard_of(self, slot: int) -> int:
    """The device range of a slot's pages (rows enter at the entry bucket only)."""
    return slot * self.shards // self.entry_bucket

  def _slots_for(self, r: int, slots: int) -> int:
    """What row r may write is bounded by its budget."""
    return min(slots, self.config.row_slots(self.prompt_lens[r], self.budgets[r]))

  def _entry(self, r: int, shard: int) -> tuple:
    """What admitting row r on `shard` needs: (prompt, prompt len, slots, pages to leave free, shard).
    Headroom: the rows already in flight keep a play's growth each, so admission does not preempt
    them at the next play (a preempted row's tokens are prefilled again)."""
    play, resumed = self.config.play_slots(None), len(self.kept[r][0]) - 1 if r in self.kept else 0
    return (self.rows[r][0], self.prompt_lens[r], self._slots_for(r, self.prompt_lens[r] + resumed + play),
            self.pages.rows_on(shard) * -(-play // self.config.page_size), shard)

  def admit(self, free_slots) -> tuple[np.ndarray, np.ndarray]:
    """Waiting rows into `free_slots` while the pool has their pages.

    Returns:
      (int32 [bucket] the row each slot takes, -1: none; int32 [bucket] the prompt slot each new
      row's prefill writes from: after its prompt's shared pages where a sibling holds them).
    """
    new, write_from = np.full((self.bucket,), -1, np.int32), np.zeros((self.bucket,), np.int32)
    for slot in free_slots:
      if not self.waiting:
        break
      r = self.waiting[0]
      if self.pages is not None:
        start = self.pages.admit(r, *self._entry(r, self._shard_of(slot)))
        if start is None:
          continue  # another free slot's device may have its pages
        write_from[slot] = start
      self.waiting.popleft()
      new[slot], self.slot_row[slot], self.entered[slot] = r, r, next(self._clock)
    return new, write_from

  def prefills(self, new: np.ndarray, write_from: np.ndarray) -> tuple[np.ndarray, list, list]:
    """How the rows `admit` put in slots `new` are prefilled.

    Returns:
      (the slots that prefill their prompt whole, as `new` with the others -1; (slot, first prompt
      slot, sibling slot) for each row that prefills only its prompt's tail after the shared pages a
      sibling in flight wrote earlier; (slot, tokens, log-probs) for each preempted row coming back,
      its kept tokens handed over).
    """
    writers = {self.rows[r][0] for slot, r in enumerate(new) if r >= 0 and write_from[slot] == 0}
    tails = []
    for slot, r in enumerate(new):
      if r >= 0 and write_from[slot] > 0 and self.rows[r][0] not in writers:
        sibling = next(s for s, q in enumerate(self.slot_row) if q >= 0 and new[s] < 0
                       and self.rows[q][0] == self.rows[r][0] and self.pages.holds(q))
        tails.append((slot, int(write_from[slot]), sibling))
    whole = new.copy()
    whole[[slot for slot, _, _ in tails]] = -1
    back = [(slot, *self.kept.pop(r)) for slot, r in enumerate(new) if r in self.kept]
    return whole, tails, back

  def release_finished(self) -> None:
    """Finished rows give their pages back at once."""
    if self.pages is not None:
      for slot in np.flatnonzero(self.done & (self.slot_row >= 0)):
        if self.pages.holds(self.slot_row[slot]):
          self.pages.release(self.slot_row[slot])

  def refill_ready(self) -> bool:
    """Enough slots are free for the next chunk of waiting rows (or all of them) and the pool has
    the first one's pages on a free slot's device; sets `blocked` when only the pages lack."""
    self.blocked = False
    if not self.waiting or self.bucket - self.active < min(self.config.refill_chunk, len(self.waiting)):
      return False
    r = self.waiting[0]
    if self.pages is None or any(self.pages.fits(*self._entry(r, s))
                                 for s in {self._shard_of(i) for i in np.flatnonzero(self.done)}):
      return True
    self.blocked = True
    return False

  def compactable(self) -> bool:
    """Nothing waits and a smaller bucket holds the active rows; paged, only once the pool holds
    them to their budgets and each device's rows fit its half (else `blocked`: wait for a row to
    finish)."""
    if self.waiting or not self.config.compact or bucket_for(self.config, self.active, self.shards) >= self.bucket:
      return False
    if self.pages is not None and (self._short(lambda i: self._slots_for(self.slot_row[i], 1 << 30))
                                   or self._halved(self.done, self.bucket) is None):
      self.blocked = True
      return False
    return True

  def compact(self) -> list[np.ndarray]:
    """Halves the bucket until it fits the active rows: the slots each halving keeps (int32 [b/2],
    -1: empty), for `steps.halve`."""
    keeps = []
    while bucket_for(self.config, self.active, self.shards) < self.bucket and \
        (keep := self._halved(self.done, self.bucket)) is not None:
      keeps.append(keep)
      gather = lambda x, empty: np.where(keep >= 0, x[keep], empty)
      self.done, self.generated = gather(self.done, True), gather(self.generated, 0)
      self.slot_row, self.entered = gather(self.slot_row, -1), self.entered[keep]
      self.bucket //= 2
    return keeps

  def _halved(self, done: np.ndarray, b: int) -> np.ndarray | None:
    """The slots bucket b // 2 keeps (-1: empty): each device's active rows into the first half of its
    slots, so no row changes device (with its pages); None if a device has too many."""
    per = b // self.shards
    keep = []
    for s in range(self.shards):
      active = [i for i in range(s * per, (s + 1) * per) if not done[i]]
      if len(active) > per // 2:
        return None
      keep += active + [-1] * (per // 2 - len(active))
    return np.asarray(keep, np.int32)

  def _play_need(self, slot: int, strategy: Strategy | None) -> int:
    """Cache slots the row of `slot` may fill by the end of a play of `strategy`."""
    r = self.slot_row[slot]
    return self._slots_for(r, self.prompt_lens[r] + int(self.generated[slot]) - 1 + self.config.play_slots(strategy))

  def _short(self, need) -> list[int]:
    """The shards whose free pages cannot give each active row `need(slot)` slots."""
    lack = collections.Counter()
    for i in np.flatnonzero(~self.done):
      r = self.slot_row[i]
      lack[self.pages.shard(r)] += self.pages.missing(r, self.prompt_lens[r], need(i))
    return [s for s, n in lack.items() if n > self.pages.free_on(s)]

  def victim(self, strategy: Strategy | None) -> int | None:
    """The slot to preempt before a play of `strategy` (None: the pool holds what it may write): on
    the first device short of pages, the row with the fewest tokens (of those, the latest in).

    Raises:
      RuntimeError: a row alone does not fit, or a compacted bucket ran short (neither happens: a
        row fits the pool, the tail compacts once all fit).
    """
    if self.pages is None or not (lacking := self._short(lambda i: self._play_need(i, strategy))):
      return None
    active = [i for i in np.flatnonzero(~self.done) if self.pages.shard(self.slot_row[i]) == lacking[0]]
    slots = np.asarray([i for i in active if self.slot_row[i] not in self.held], np.int64)
    if len(active) == 1 or not len(slots) or self.bucket != self.entry_bucket:
      raise RuntimeError(f"the page pool ({self.pages.num_pages} pages) cannot hold the rows of bucket {self.bucket}")
    return int(slots[np.lexsort((-self.entered[slots], self.generated[slots]))[0]])

  def preempt(self, slot: int, tokens: np.ndarray, logprobs: np.ndarray) -> None:
    """Frees `slot`'s pages and puts its row, with its `tokens` and `logprobs` so far, first in line."""
    r = self.slot_row[slot]
    self.pages.release(r)
    self.waiting.appendleft(r)
    self.kept[r] = tokens, logprobs
    self.slot_row[slot], self.done[slot] = -1, True

  def take_turn(self, slot: int, n: int) -> bool:
    """The row of `slot`, back from its tools, takes the pages that the `n` tokens its tool turn appends
    fill (paged); False while its device lacks them (rows finishing give theirs back)."""
    if self.pages is None:
      return True
    r = self.slot_row[slot]
    need = self._slots_for(r, self.prompt_lens[r] + int(self.generated[slot]) - 1 + n)
    if self.pages.missing(r, self.prompt_lens[r], need) > self.pages.free_on(self.pages.shard(r)):
      return False
    self.pages.grow(r, self.prompt_lens[r], need)
    return True

  def reserve(self, strategy: Strategy | None) -> None:
    """Every active row takes the pages a play of `strategy` may write (after `victim` found none short)."""
    if self.pages is not None:
      for i in np.flatnonzero(~self.done):
        self.pages.grow(self.slot_row[i], self.prompt_lens[self.slot_row[i]], self._play_need(i, strategy))

  def stop_at(self, before_tail: bool) -> int:
    """Active rows at which the play ends on the device: once enough slots are free for a refill
    (when rows wait for pages, or the tail for the pages to compact: once a row finishes), or, with
    nothing waiting, once a smaller bucket fits the active rows (compaction); `before_tail`: at the
    latest once the tail begins (the bandit's turn)."""
    cfg = self.config
    if self.blocked:
      stop = self.active - 1
    elif self.waiting:
      stop = self.bucket - min(cfg.refill_chunk, len(self.waiting))
    else:
      stop = self.bucket // 2 if cfg.compact else 0
    return max(stop, cfg.sd_max_batch) if before_tail else stop
