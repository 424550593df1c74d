"""Host-side page allocator: a free list plus a reference count per page.

A prompt's full pages are shared by its `n` samples (one reference each, plus one held by the
prefilled prompt until its last sample is inserted); a page returns to the free list when its
count drops to zero. Pure Python, no device work.
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
        self._free = collections.deque(range(num_pages))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` fresh pages with one reference each. Raises OutOfPagesError (nothing taken)."""
        if count > len(self._free):
            raise OutOfPagesError(f"asked for {count} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(count)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Adds one reference to each (already allocated) page."""
        for p in pages:
            if self._refs[p] == 0:
                raise ValueError(f"page {p} is free and cannot be shared")
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drops one reference from each page; pages reaching zero become free."""
        for p in pages:
            if self._refs[p] == 0:
                raise ValueError(f"page {p} released more often than allocated")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]
