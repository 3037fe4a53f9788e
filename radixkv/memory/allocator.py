"""KV memory bookkeeping: which slots of the KV pool are free.

Slot indices are what the prefix caches store and what the attention kernels
read. Slots are grouped in pages of ``page_size`` consecutive slots (a
FlashInfer page); an allocation always starts on a page boundary and takes
whole pages, and a page returns to the free list only when all of its slots
are free again.
"""

from __future__ import annotations

import numpy as np

from radixkv.tokens import TokenSeq, as_token_array


def _count_values(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values and how often each occurs: a bincount over the span when it is
    small (the usual case: a request's pages are few and close), a sort otherwise."""
    lo, hi = int(values.min()), int(values.max())
    if hi - lo < 4 * len(values) + 64:
        counts = np.bincount(values - lo)
        present = np.flatnonzero(counts)
        return present + lo, counts[present].astype(np.int32)
    distinct, counts = np.unique(values, return_counts=True)
    return distinct, counts.astype(np.int32)


class OutOfSlotsError(MemoryError):
    """Not enough free KV slots for an allocation (nothing was allocated)."""


class SlotAllocator:
    """Page-aligned allocator of KV slot indices ``0 .. num_slots - 1``.

    Args:
        num_slots: capacity in slots (tokens); rounded down to whole pages.
        page_size: slots per page.

    ``alloc(n)`` takes ``ceil(n / page_size)`` free pages and returns the
    first ``n`` of their slots; the rest of the last page is held until every
    returned slot of that page is freed. ``num_free`` counts slots in free
    pages. Costs: ``alloc`` O(pages taken), ``free`` O(len(indices)) numpy work
    (O(len(indices) log len(indices)) where the pages freed are far apart, and
    the first free of several slots allocates one capacity-sized scratch array).

    >>> a = SlotAllocator(8, page_size=4)
    >>> a.alloc(5).tolist()
    [0, 1, 2, 3, 4]
    >>> a.num_free
    0
    """

    def __init__(self, num_slots: int, page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.page_size = int(page_size)
        self.num_pages = int(num_slots) // self.page_size
        self.reset()

    def reset(self) -> None:
        """Every slot free again. O(num_pages)."""
        # Free page ids as a numpy stack (no Python int per page: capacities reach 10^8 slots
        # in trace replays); reversed so the first allocations get pages 0, 1, 2, ...
        dtype = np.int32 if self.num_pages < 2**31 else np.int64
        self._stack = np.arange(self.num_pages - 1, -1, -1, dtype=dtype)
        self._top = self.num_pages  # pages in the stack
        self._live = np.zeros(self.num_pages * self.page_size, dtype=bool)
        # Live slots per page; only needed when a page holds several slots.
        self._page_live = np.zeros(self.num_pages if self.page_size > 1 else 0, dtype=np.int32)
        self._scratch: np.ndarray | None = None  # for _has_repeats, allocated on first use

    @property
    def capacity(self) -> int:
        """Total slots (whole pages)."""
        return self.num_pages * self.page_size

    @property
    def num_free(self) -> int:
        """Slots in free pages, available to ``alloc``."""
        return self._top * self.page_size

    @property
    def num_used(self) -> int:
        """Slots handed out and not yet freed (not counting the held rest of a partial page). O(capacity)."""
        return int(np.count_nonzero(self._live))

    def alloc(self, n: int) -> np.ndarray:
        """``n`` slot indices (int64) starting on a page boundary.

        Raises ``OutOfSlotsError`` (a ``MemoryError``) and changes nothing when
        fewer than ``ceil(n / page_size)`` pages are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        ps = self.page_size
        pages_needed = -(-n // ps)
        if pages_needed > self._top:
            raise OutOfSlotsError(f"need {n} slots ({pages_needed} pages of {ps}) but only {self.num_free} slots "
                                  f"({self._top} pages) are free")
        if pages_needed == 0:
            return np.zeros(0, dtype=np.int64)
        pages = self._stack[self._top - pages_needed : self._top][::-1].astype(np.int64)
        self._top -= pages_needed
        if ps == 1:
            slots = pages
        else:
            slots = (pages[:, None] * ps + np.arange(ps, dtype=np.int64)).ravel()[:n]
            self._page_live[pages] = ps
            if n % ps:
                self._page_live[pages[-1]] = n % ps
        self._live[slots] = True
        return slots

    def extend(self, last_slot: int | None, n: int) -> np.ndarray:
        """``n`` more slots for a sequence whose last slot is ``last_slot`` (None: it has none yet).

        Continues in the rest of ``last_slot``'s page (held for that allocation
        since ``alloc``), then takes whole new pages, so a sequence's slots
        always fill pages in order: what paged attention kernels and
        page-granular caches need. Raises ``OutOfSlotsError`` and changes
        nothing when the new pages are not free.
        """
        ps = self.page_size
        room = 0 if last_slot is None or ps == 1 else ps - 1 - int(last_slot) % ps
        take = min(room, n)
        if take and self._live[int(last_slot) + 1 : int(last_slot) + 1 + take].any():
            raise ValueError(f"the slots after {last_slot} are already in use: not the end of a sequence")
        if n - take > self.num_free:
            raise OutOfSlotsError(f"need {n - take} new slots but only {self.num_free} are free")
        head = np.arange(int(last_slot) + 1, int(last_slot) + 1 + take, dtype=np.int64) if take else None
        tail = self.alloc(n - take)
        if head is None:
            return tail
        self._live[head] = True
        self._page_live[int(last_slot) // ps] += take
        return np.concatenate([head, tail])

    def free(self, indices: TokenSeq) -> None:
        """Give slots back. A page returns to the free list once all its slots are free.

        Raises ``ValueError`` and changes nothing when an index is out of
        range, repeated, or not currently allocated (a double free).
        """
        idx = as_token_array(indices)
        if idx.size == 0:
            return
        if idx.min() < 0 or idx.max() >= self.capacity:
            raise ValueError(f"slot index out of range [0, {self.capacity}): {idx.min()}..{idx.max()}")
        live = self._live[idx]
        if not live.all():
            raise ValueError(f"freeing slots that are not allocated (double free?): {idx[~live][:8].tolist()}")
        if len(idx) > 1 and self._has_repeats(idx):
            raise ValueError("the same slot appears twice in one free() call")
        self._live[idx] = False
        if self.page_size == 1:
            returned = idx
        else:
            pages, counts = _count_values(idx // self.page_size)
            self._page_live[pages] -= counts
            returned = pages[self._page_live[pages] == 0]
        self._stack[self._top : self._top + len(returned)] = returned
        self._top += len(returned)

    def retain(self, indices: TokenSeq) -> None:
        """Free every slot but ``indices`` (which become allocated, whole pages held): the books rebuilt from
        what the caller knows it holds, after a failure left them unknown. O(capacity)."""
        idx = as_token_array(indices)
        if idx.size and (idx.min() < 0 or idx.max() >= self.capacity):
            raise ValueError(f"slot index out of range [0, {self.capacity}): {idx.min()}..{idx.max()}")
        self._live[:] = False
        self._live[idx] = True
        per_page = self._live.reshape(self.num_pages, self.page_size).sum(axis=1)
        if self.page_size > 1:
            self._page_live[:] = per_page
        free = np.flatnonzero(per_page == 0)[::-1].astype(self._stack.dtype)  # lowest page id on top
        self._stack[: len(free)] = free
        self._top = len(free)

    def _has_repeats(self, idx: np.ndarray) -> bool:
        """Whether ``idx`` (in range) lists a slot twice. O(len(idx)), no sort.

        Each position writes its own number into a scratch array at its slot;
        a repeated slot keeps only the last writer, so an earlier position
        reads back a number that is not its own.
        """
        if self._scratch is None:
            self._scratch = np.zeros(self.capacity, dtype=np.int64)
        order = np.arange(len(idx), dtype=np.int64)
        self._scratch[idx] = order
        return not np.array_equal(self._scratch[idx], order)

    def check_invariants(self) -> None:
        """Free pages hold no live slot; live counts match the live mask. O(num_slots)."""
        live_per_page = self._live.reshape(self.num_pages, self.page_size).sum(axis=1)
        if self.page_size > 1 and not np.array_equal(live_per_page, self._page_live):
            raise AssertionError("SlotAllocator invariant 'page live counts match the live mask' broken")
        free = self._stack[: self._top]
        if len(free) and np.bincount(free, minlength=self.num_pages).max() > 1:
            raise AssertionError("SlotAllocator invariant 'free pages unique' broken")
        if len(free) and live_per_page[free].any():
            raise AssertionError("SlotAllocator invariant 'free pages hold no live slot' broken")
        if len(free) != int((live_per_page == 0).sum()):
            raise AssertionError("SlotAllocator invariant 'every page without a live slot is free' broken")

    def __repr__(self) -> str:
        return f"SlotAllocator(capacity={self.capacity}, page_size={self.page_size}, free={self.num_free})"
