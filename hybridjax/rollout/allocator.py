"""Host-side page allocator: a free list plus a reference count per page.

A prompt's full pages are shared by its `n` samples (one reference each, plus one held by the
prefilled prompt until its last sample is inserted); a page returns to the free list when its
count drops to zero.

A freed page keeps its keys/values until it is handed out again: the free list gives out the
longest-free page first (vLLM's LRU eviction of cached blocks), and each allocation starts a new
generation of the page. A page number remembered with its generation (`generations`) therefore
tells whether the page still holds what it held then, free or not, and `take` gets it back
(`hybridjax.rollout.prefix_cache`). Pure Python, no device work.
"""

from __future__ import annotations

import collections


class OutOfPagesError(RuntimeError):
    """More pages were asked for than are free."""


class PageAllocator:
    """Pages 0 .. num_pages-1; `allocate` pops from the free list, `release` decrements."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        # free pages, the longest free first (an ordered set)
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(num_pages)
        )
        self._refs = [0] * num_pages
        self._generation = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` fresh pages (the longest free first, each in a new generation) with one
        reference each. Raises OutOfPagesError (nothing taken)."""
        if count > len(self._free):
            raise OutOfPagesError(f"asked for {count} pages, {len(self._free)} free")
        pages = [self._free.popitem(last=False)[0] for _ in range(count)]
        for p in pages:
            self._refs[p] = 1
            self._generation[p] += 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Adds one reference to each (already allocated) page."""
        for p in pages:
            if self._refs[p] == 0:
                raise ValueError(f"page {p} is free and cannot be shared")
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drops one reference from each page; pages reaching zero become free (their
        contents kept until they are allocated again)."""
        for p in pages:
            if self._refs[p] == 0:
                raise ValueError(f"page {p} released more often than allocated")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free[p] = None

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def generations(self, pages: list[int]) -> tuple[int, ...]:
        """The current generation of each page (bumped by every `allocate` of it)."""
        return tuple(self._generation[p] for p in pages)

    def num_free_among(self, pages: list[int]) -> int:
        """How many of `pages` are free (what `take` draws from the free list)."""
        return sum(self._refs[p] == 0 for p in pages)

    def take(self, pages: list[int]) -> None:
        """One more reference to each of `pages`, free ones included: a free one leaves the
        free list with its contents."""
        for p in pages:
            if self._refs[p] == 0:
                del self._free[p]
            self._refs[p] += 1
