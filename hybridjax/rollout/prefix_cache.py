"""Full KV pages found again by the tokens they hold (vLLM's automatic prefix caching).

A page of `page_size` positions is keyed by a digest of every token up to its end (a chain: the
previous page's digest and the page's own tokens, BLAKE2b, as vLLM's block hashes), so two
sequences with the same tokens up to a page's end find the same page. An entry also records the
page's generation (`PageAllocator.generations`): a page allocated anew since holds other keys
and values, and its entry is stale. Entries are made when a sequence is preempted (its full
pages, which it frees) and when one is readmitted (the pages its tokens are recomputed into),
so a preempted sample finds its prompt's pages held by its siblings, or recomputed by the first
of them to come back, and its own pages while they were not handed out again. Host only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from hybridjax.rollout.allocator import PageAllocator


def page_digests(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """The digest of each full page of `tokens` (positions 0 .. len(tokens) - 1): page k's
    covers tokens 0 .. (k + 1)·page_size - 1."""
    digests, previous = [], b""
    for k in range(len(tokens) // page_size):
        block = np.asarray(tokens[k * page_size : (k + 1) * page_size], np.int64)
        previous = hashlib.blake2b(previous + block.tobytes(), digest_size=16).digest()
        digests.append(previous)
    return digests


class PrefixCache:
    """Pages of one pool by the digest of the tokens they hold.

    Args:
      allocator: the pool's allocator (whose generations tell stale entries).
      page_size: positions per page.
    """

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self._pages: dict[bytes, tuple[int, int]] = {}  # digest -> (page, generation)
        # each page's generation at the last `clear`: a page not allocated since holds keys
        # and values of the weights before it, and is never recorded
        self._cleared_at = allocator.generations(list(range(allocator.num_pages)))

    def __len__(self) -> int:
        return len(self._pages)

    def register(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Records `pages` as holding the keys/values of `tokens`' full pages (the first
        len(tokens) // page_size of them), in their current generation, up to the first page
        not allocated since the last `clear` (computed with the weights before it: it and
        every later page of the chain are left out). Stale entries are dropped once they
        outnumber the pool's pages."""
        self.record(page_digests(tokens, self.page_size), pages)

    def record(self, digests: Sequence[bytes], pages: Sequence[int]) -> None:
        """`register` of the tokens whose `page_digests` are `digests`."""
        for digest, page in zip(digests, pages, strict=False):
            generation = self.allocator.generations([page])[0]
            if generation == self._cleared_at[page]:
                break
            self._pages[digest] = (page, generation)
        if len(self._pages) > 2 * self.allocator.num_pages:  # at most one live entry per page
            self._pages = {
                d: (p, g)
                for d, (p, g) in self._pages.items()
                if self.allocator.generations([p])[0] == g
            }

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """The pages holding the keys/values of `tokens`' leading full pages, as far as each
        is cached in the generation it was recorded in (stale entries are dropped)."""
        return self.find(page_digests(tokens, self.page_size))

    def find(self, digests: Sequence[bytes]) -> list[int]:
        """`lookup` of the tokens whose `page_digests` are `digests`."""
        found = []
        for digest in digests:
            entry = self._pages.get(digest)
            if entry is None:
                break
            page, generation = entry
            if self.allocator.generations([page])[0] != generation:
                del self._pages[digest]
                break
            found.append(page)
        return found

    def clear(self) -> None:
        """Forgets every entry, and records no page computed before now (the pool's keys and
        values are no longer the engine's: new weights, or the pool released)."""
        self._pages.clear()
        self._cleared_at = self.allocator.generations(list(range(self.allocator.num_pages)))
