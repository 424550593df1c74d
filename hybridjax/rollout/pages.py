"""Which KV pages each prompt and sequence holds (host bookkeeping, no device work).

A prompt of length L with n samples:
  * when admitted (`PageBook.admit`), its prefill pages (positions 0 .. L-2) are allocated and
    the pages its samples take when inserted are reserved;
  * each sample (`PageBook.sample_pages`) shares the prompt's full pages and gets its own copy
    of the partly filled last page (the last sample takes the original: no copy); the copies
    are queued for the next decode call (`pop_copies`);
  * with `rollout.page_allocation` = "on_demand" (vLLM's block manager) a sample takes nothing
    more at insertion: its sequence takes a page when it grows into one (`grow`), and when a
    replica has no free page the engine preempts its youngest sequences
    (`hybridjax.rollout.preemption`). With "reserve" a sample takes the fresh pages of its whole
    response at insertion (prompt + max_tokens, the worst case), so it never runs out;
  * a finished sequence's pages go back with `release`; shared pages are reference-counted
    (`PageAllocator`);
  * on demand, a group (or a preempted sequence coming back) is admitted only if the pool keeps
    a watermark of free pages after it (`watermark_pages`, vLLM's block manager), so the running
    sequences have pages to grow into before one must be preempted.
"""

from __future__ import annotations

import dataclasses

from hybridjax.rollout.allocator import PageAllocator
from hybridjax.rollout.config import RolloutConfig, SamplingParams
from hybridjax.rollout.prefix_cache import PrefixCache


def num_pages(positions: int, page_size: int) -> int:
    """Pages that hold `positions` positions."""
    return -(-positions // page_size)


def watermark_pages(watermark: float, total: int) -> int:
    """Free pages an admission must leave in a pool of `total` pages: int(watermark × total),
    as vLLM's block manager (`watermark` a fraction; 0.01 of 384 pages is 3)."""
    return int(watermark * total)


def chunk_sizes(
    remaining: list[int], budget: int, chunked: bool, overrun: bool = True
) -> list[int]:
    """Prompt tokens to prefill this engine step for prompts that still need `remaining`
    tokens each, in order, under a `budget` of tokens (what `rollout.max_num_batched_tokens`
    leaves after the step's decode tokens, `decode_tokens`). `chunked`
    (`enable_chunked_prefill`): each takes what is left of the budget, the last one a part;
    else whole prompts while they fit (vLLM's scheduler, FCFS: it stops at the first that does
    not fit), and with `overrun` (a step without decode tokens) the first always, so a prompt
    longer than the whole budget still runs."""
    sizes, left = [0] * len(remaining), budget
    for i, need in enumerate(remaining):
        if need == 0:
            continue
        first = overrun and left == budget
        take = min(need, left) if chunked else (need if need <= left or first else 0)
        if take <= 0:
            break
        sizes[i], left = take, left - take
    return sizes


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to sample: token ids, sampling parameters and its index (folded into the
    PRNG key, so different prompts draw independent noise under one seed)."""

    prompt: tuple[int, ...]
    params: SamplingParams
    index: int = 0


@dataclasses.dataclass
class Prefix:
    """A prefilled prompt, waiting for its samples to be inserted into slots (host object)."""

    request: Request
    shared_pages: list[int]  # full pages of positions 0 .. L-2, shared by every sample
    partial_page: int | None  # the partly filled last prompt page, if any
    next_sample: int = 0
    replica: int = 0  # the data-parallel replica whose pool holds the pages
    prefilled: int = 0  # positions 0 .. prefilled-1 computed (chunked prefill)
    # with rollout routing replay: the experts of positions 0 .. prefilled-1, one entry per
    # prefill chunk (`Engine.routing_of`)
    routing: list = dataclasses.field(default_factory=list)

    @property
    def to_prefill(self) -> int:
        """Prompt positions (0 .. L-2) not computed yet; samples are inserted at 0."""
        return len(self.request.prompt) - 1 - self.prefilled

    @property
    def samples_left(self) -> int:
        return self.request.params.n - self.next_sample

    @property
    def pages(self) -> list[int]:
        """Every page of the prefilled prompt, in position order."""
        return self.shared_pages + ([] if self.partial_page is None else [self.partial_page])


class PageBook:
    """The pool's pages: free list, reservations of admitted groups, pending page copies.

    Args:
      config: the engine's sizes (`page_size`).
      total: pages in the pool (per layer).
    """

    def __init__(self, config: RolloutConfig, total: int):
        self.page_size = config.page_size
        self.on_demand = config.page_allocation == "on_demand"
        self.total = total
        # pages an admission leaves free (on demand only: reserved pages never run out)
        self.watermark = watermark_pages(config.watermark, total) if self.on_demand else 0
        self.allocator = PageAllocator(total)
        self.cache = PrefixCache(self.allocator, config.page_size)  # full pages by tokens
        self.reserved = 0  # pages promised to samples of admitted prompts not yet inserted
        self.copies: list[tuple[int, int]] = []  # (src, dst) page copies due before decoding

    def pages_for(self, prompt_len: int, params: SamplingParams) -> tuple[int, int]:
        """(pages of the prefilled prompt, pages each sample adds): the prompt holds positions
        0 .. L-2; a sample holds positions up to L - 2 + max_tokens."""
        ps = self.page_size
        prefix = num_pages(prompt_len - 1, ps)
        per_sample = num_pages(prompt_len - 1 + params.max_tokens, ps) - (prompt_len - 1) // ps
        return prefix, per_sample

    def insert_pages(self, prompt_len: int, params: SamplingParams) -> int:
        """Pages a sample takes of its own at insertion: its whole response ("reserve"), or
        only its copy of the partial prompt page, if any ("on_demand")."""
        if self.on_demand:
            return int(self._has_partial(prompt_len))
        return self.pages_for(prompt_len, params)[1]

    def group_pages(self, prompt_len: int, params: SamplingParams) -> int:
        """Pages a prompt's whole group holds at most (the last sample takes over the partial
        prompt page, so it is counted once)."""
        prefix, per_sample = self.pages_for(prompt_len, params)
        return prefix + params.n * per_sample - int(self._has_partial(prompt_len))

    def _has_partial(self, prompt_len: int) -> bool:
        return (prompt_len - 1) % self.page_size != 0

    def admit_pages(self, prompt_len: int, params: SamplingParams) -> int:
        """Pages a group takes from admission to the insertion of its last sample: all it
        ever holds ("reserve", `group_pages`), or its prompt and the samples' copies of the
        partial page ("on_demand")."""
        prefix = self.pages_for(prompt_len, params)[0]
        own = self.insert_pages(prompt_len, params)
        return prefix + params.n * own - int(self._has_partial(prompt_len))

    def can_allocate(self, count: int) -> bool:
        """Whether `count` pages are free beyond those promised to waiting samples."""
        return self.allocator.num_free - self.reserved >= count

    def can_admit_pages(self, count: int) -> bool:
        """Whether a new sequence or group may take `count` pages now: they are free (beyond
        those promised to waiting samples) and the watermark stays free after them."""
        return self.can_allocate(count + self.watermark)

    def can_admit(self, request: Request) -> bool:
        """Whether the free pages (less those promised to waiting samples and the watermark)
        hold the group until its samples are inserted (`admit_pages`)."""
        return self.can_admit_pages(self.admit_pages(len(request.prompt), request.params))

    def grow(self, count: int) -> list[int] | None:
        """`count` fresh pages for a running sequence, or None when fewer are free (beyond
        those promised to waiting samples): the caller preempts and retries."""
        return self.allocator.allocate(count) if self.can_allocate(count) else None

    def admit(self, request: Request) -> Prefix:
        """Allocates the prompt's prefill pages and reserves its samples' pages. Raises
        RuntimeError when the group does not fit now (check `can_admit` first)."""
        if not self.can_admit(request):
            raise RuntimeError(f"request {request.index}: not enough free pages now")
        prefix_pages = self.pages_for(len(request.prompt), request.params)[0]
        pages = self.allocator.allocate(prefix_pages)
        self.reserved += self.admit_pages(len(request.prompt), request.params) - prefix_pages
        partial = self._has_partial(len(request.prompt))
        shared, last = (pages[:-1], pages[-1]) if partial else (pages, None)
        return Prefix(request, shared, last)

    def sample_pages(self, prefix: Prefix) -> list[int]:
        """The page table of the prefix's next sample (and counts it as inserted): the shared
        pages, then its own. Queues the copy of the partial prompt page it needs."""
        if prefix.samples_left <= 0:
            raise ValueError(f"request {prefix.request.index}: every sample is already inserted")
        prefix.next_sample += 1
        per_sample = self.insert_pages(len(prefix.request.prompt), prefix.request.params)
        self.allocator.share(prefix.shared_pages)
        if prefix.partial_page is None:
            own = self.allocator.allocate(per_sample)
        elif prefix.samples_left == 0:  # last sample: takes over the original partial page
            own = [prefix.partial_page] + self.allocator.allocate(per_sample - 1)
        else:
            own = self.allocator.allocate(per_sample)
            self.copies.append((prefix.partial_page, own[0]))
        self.reserved -= len(own) - int(own[:1] == [prefix.partial_page])
        if prefix.samples_left == 0:
            self.allocator.release(prefix.shared_pages)  # the prefix's own references
        return prefix.shared_pages + own

    def release(self, pages: list[int]) -> None:
        """Returns a sequence's pages (shared ones when their last holder lets go)."""
        self.allocator.release(pages)

    def pop_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) page copies queued since the last call."""
        copies, self.copies = self.copies, []
        return copies
