"""Properties of the rollout's page bookkeeping: no page is ever held twice unless shared, a
page's reference count is the number of its holders, and releasing everything frees the pool.

`PageAllocator` is driven by random allocate / share / take / release sequences against a
plain dict model (a page's generation counts its allocations); `PageBook` by random groups
admitted, their samples inserted and sequences released in random orders, checking every live
page table after each operation.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridjax.rollout.allocator import OutOfPagesError, PageAllocator
from hybridjax.rollout.config import PAGE_ALLOCATIONS, RolloutConfig, SamplingParams
from hybridjax.rollout.pages import PageBook, Request, num_pages

FAST = settings(max_examples=40, deadline=None)


class AllocatorMachine(RuleBasedStateMachine):
    """The allocator against a model: page -> references held (absent = free)."""

    def __init__(self):
        super().__init__()
        self.pool = PageAllocator(12)
        self.refs: collections.Counter[int] = collections.Counter()
        self.allocations: collections.Counter[int] = collections.Counter()  # per page

    @rule(count=st.integers(0, 6))
    def allocate(self, count):
        free_before = self.pool.num_free
        if count > free_before:
            with pytest.raises(OutOfPagesError):
                self.pool.allocate(count)
            assert self.pool.num_free == free_before  # nothing taken
            return
        pages = self.pool.allocate(count)
        assert len(set(pages)) == count
        assert not any(self.refs[p] for p in pages), "a held page was handed out again"
        self.refs.update(pages)
        self.allocations.update(pages)

    @rule(data=st.data())
    def take(self, data):
        """Held or free pages come back (a prefix cache hit): free ones leave the free list."""
        pages = data.draw(st.lists(st.integers(0, 11), max_size=3, unique=True))
        self.pool.take(pages)
        self.refs.update(pages)

    @precondition(lambda self: +self.refs)
    @rule(data=st.data())
    def share(self, data):
        pages = data.draw(st.lists(st.sampled_from(sorted(+self.refs)), max_size=3))
        self.pool.share(pages)
        self.refs.update(pages)

    @precondition(lambda self: +self.refs)
    @rule(data=st.data())
    def release(self, data):
        held = sorted((+self.refs).elements())
        pages = data.draw(st.lists(st.sampled_from(held), max_size=3, unique=True))
        self.pool.release(pages)
        self.refs.subtract(pages)

    @rule(page=st.integers(0, 11))
    def release_a_free_page_raises(self, page):
        if self.refs[page] == 0:
            with pytest.raises(ValueError, match="released more often"):
                self.pool.release([page])

    @invariant()
    def counts_match_the_model(self):
        for page in range(self.pool.num_pages):
            assert self.pool.refcount(page) == self.refs[page]
        assert self.pool.num_used == len(+self.refs)
        assert self.pool.num_free + self.pool.num_used == self.pool.num_pages
        # a page's generation changes exactly when it is allocated anew
        assert self.pool.generations(list(range(12))) == tuple(
            self.allocations[p] for p in range(12)
        )


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)

groups = st.lists(
    st.tuples(st.integers(1, 20), st.integers(1, 4), st.integers(1, 12)),  # prompt len, n, max
    min_size=1,
    max_size=6,
)


def _holders(tables: list[list[int]], prefixes: list) -> collections.Counter:
    """References each page should have: one per live page table holding it, and one per
    pending prefix for its shared pages (the prefix's own, until its last sample is in)."""
    held: collections.Counter[int] = collections.Counter()
    for table in tables:
        held.update(table)
    for prefix in prefixes:
        if prefix.samples_left > 0:
            held.update(prefix.shared_pages)
            if prefix.partial_page is not None:
                held.update([prefix.partial_page])
    return held


@FAST
@given(
    groups=groups,
    page_size=st.integers(1, 5),
    order=st.randoms(use_true_random=False),
    mode=st.sampled_from(PAGE_ALLOCATIONS),
)
def test_page_book_never_double_allocates_and_frees_everything(groups, page_size, order, mode):
    book = PageBook(RolloutConfig(page_size=page_size, page_allocation=mode), total=64)
    prefixes, samples = [], []
    for index, (length, n, max_tokens) in enumerate(groups):
        request = Request(tuple(range(length)), SamplingParams(n=n, max_tokens=max_tokens), index)
        if book.can_admit(request):
            prefixes.append(book.admit(request))
            samples += [prefixes[-1]] * n
    order.shuffle(samples)  # samples of different groups inserted interleaved
    steps = ["insert"] * len(samples) + ["release"] * len(samples)
    order.shuffle(steps)  # and sequences finishing in between
    tables: list[list[int]] = []
    for step in steps:
        if step == "insert" and samples:
            prefix = samples.pop()
            table = book.sample_pages(prefix)
            length, max_tokens = len(prefix.request.prompt), prefix.request.params.max_tokens
            # its positions: all of them reserved, or on demand the prompt's only
            grown = max_tokens if mode == "reserve" else 0
            assert len(table) == num_pages(length - 1 + grown, page_size)
            tables.append(table)
        elif step == "release" and tables:
            book.release(tables.pop(order.randrange(len(tables))))
        held = _holders(tables, prefixes)
        for page in range(book.total):
            assert book.allocator.refcount(page) == held[page], f"page {page}"
        assert 0 <= book.reserved and book.allocator.num_used + book.reserved <= book.total
    while samples:
        tables.append(book.sample_pages(samples.pop()))
    for table in tables:
        book.release(table)
    assert book.allocator.num_free == book.total
    assert book.reserved == 0
