"""A preempted sequence comes back on top of its full pages that still hold its keys/values
(its siblings' prompt pages, or freed pages not handed out since: only its later positions
recomputed), or on fresh pages once they were handed out or the weights changed; readmission
spends the token budget. Host bookkeeping against hand-counted pages, and an engine whose
samples under such readmissions equal an unpreempted run's."""

import dataclasses

import numpy as np
from conftest import ENGINE_CONFIG
from rollout_testing import make_prompts

from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate
from hybridjax.rollout.allocator import PageAllocator
from hybridjax.rollout.pages import Request
from hybridjax.rollout.prefix_cache import PrefixCache, page_digests
from hybridjax.rollout.scheduler import Scheduler
from hybridjax.rollout.slots import Row

# 4-token pages; a prompt of 10 tokens prefills positions 0..8: pages 0, 1 full (shared by
# the group's samples) and page 2 partial (each sample its own copy).
CONFIG = RolloutConfig(
    page_size=4,
    max_num_seqs=4,
    prompt_length=16,
    response_length=8,
    decode_steps_per_call=2,
    max_num_batched_tokens=64,
)
PROMPT = tuple(range(1, 11))


def test_freed_pages_keep_their_generation_until_handed_out_again():
    """The free list hands out the longest-free page first; a freed page keeps its
    generation (and contents) until then, and `take` gets it back from the free list."""
    allocator = PageAllocator(4)
    a, b = allocator.allocate(2)
    gens = allocator.generations([a, b])
    allocator.release([a, b])
    assert allocator.generations([a, b]) == gens and allocator.num_free_among([a, b]) == 2
    assert allocator.allocate(2) == [2, 3]  # free since the start: first out
    allocator.take([a])
    assert allocator.num_free == 1 and allocator.refcount(a) == 1
    assert allocator.allocate(1) == [b] and allocator.generations([b]) != gens[1:]


def test_prefix_cache_finds_pages_by_their_tokens_while_not_handed_out():
    """Digests chain: equal tokens up to a page's end give equal digests, a different token in
    page 0 changes every later one. A lookup stops at the first page not recorded or
    allocated anew since."""
    d = page_digests(list(range(10)), 4)
    assert len(d) == 2 and d == page_digests(list(range(8)) + [99, 98], 4)
    other = page_digests([7] + list(range(1, 10)), 4)
    assert other[0] != d[0] and other[1] != d[1]
    allocator = PageAllocator(8)
    cache = PrefixCache(allocator, 4)
    pages = allocator.allocate(3)
    cache.register(list(range(11)), pages)  # 2 full pages: the third is not recorded
    assert len(cache) == 2
    assert cache.lookup(list(range(9))) == pages[:2]
    assert cache.lookup(list(range(7))) == pages[:1]
    assert cache.lookup([5] + list(range(1, 9))) == []
    allocator.release(pages)  # free: still found
    assert cache.lookup(list(range(8))) == pages[:2]
    allocator.allocate(6)  # the 5 never used, then pages[0] (the longest free)
    assert cache.lookup(list(range(8))) == [] and len(cache) == 1  # the stale entry dropped
    cache.clear()
    assert len(cache) == 0


def test_prefix_cache_drops_stale_entries_as_it_grows():
    """Pages handed out again and again under new tokens: the cache keeps at most about two
    entries per page of the pool, and every live one."""
    allocator = PageAllocator(4)
    cache = PrefixCache(allocator, 4)
    for i in range(50):
        pages = allocator.allocate(2)
        cache.register(list(range(i, i + 8)), pages)
        assert cache.lookup(list(range(i, i + 8))) == pages
        allocator.release(pages)
        assert len(cache) <= 2 * 4 + 2


def _running_group(scheduler: Scheduler, n: int = 2, prompt: tuple = PROMPT) -> list[int]:
    """A 10-token prompt with n samples on replica 0, each in a slot having sampled 3 tokens
    (positions 9..11 fed, next input at 12, 4 pages held): returns their slots."""
    request = Request(prompt, SamplingParams(n=n, max_tokens=8), index=0)
    prefix = scheduler.pages.admit(request, 0)
    slots = []
    for sample in range(n):
        pages = scheduler.pages.sample_pages(prefix)
        slot = scheduler.free_slots_of(0)[0]
        row = Row(token=5, position=9, max_tokens=8, pages=pages, temperature=1.0, top_k=0,
                  top_p=1.0, seed=(0, 0, sample), stop_ids=())  # fmt: skip
        scheduler.assign(slot, row, len(prompt) + 8, prompt)
        assert scheduler.ensure_pages(slot, 1)  # page 3 for positions 12..15
        slots.append(slot)
    for sample, slot in enumerate(slots):  # 3 tokens sampled, each sample its own first
        scheduler.history[slot] += [5 + sample, 6, 7]  # fed at 9..11, the next input at 12
        scheduler.slots.position[slot] = 12
        scheduler.slots.num_generated[slot] = 3
    scheduler.pages.pop_copies()
    return slots


def test_a_preempted_sample_comes_back_on_its_cached_pages():
    """Its 3 full pages (the 2 shared prompt pages and its own page of positions 8..11) still
    hold its keys/values: it comes back on them with nothing to recompute (start 12, its next
    input's position), and takes one fresh page for positions 12..13."""
    scheduler = Scheduler(CONFIG, replicas=1, num_pages=32)
    first, second = _running_group(scheduler)
    full = scheduler.slot_pages[second][:3]
    assert scheduler.slot_pages[first][:2] == full[:2]
    assert scheduler.pages.books[0].allocator.num_used == 6  # 2 shared + 2 × (own 2 + page 3)
    scheduler.preempt(second)
    seq = scheduler.preempted[0]
    assert seq.replica == 0
    assert scheduler.pages.books[0].allocator.num_used == 4  # its 2 own pages freed
    [(slot, back, start)] = scheduler.readmit()
    assert back is seq and start == 12 and len(seq.tokens) - 1 == 12
    assert scheduler.slot_pages[slot][:3] == full and len(scheduler.slot_pages[slot]) == 4
    assert scheduler.pages.books[0].allocator.num_used == 6
    assert scheduler.recomputed == [0]


def _hand_out_free_pages(scheduler: Scheduler) -> None:
    """Allocates and frees every free page: none keeps what it held."""
    allocator = scheduler.pages.books[0].allocator
    allocator.release(allocator.allocate(allocator.num_free))


def test_pages_handed_out_or_stale_are_recomputed():
    """Its own full page handed out again: it comes back on the 2 prompt pages its sibling
    holds (positions 8..11 recomputed). The sibling gone and those pages handed out too, or
    the weights changed: recomputed from 0 into fresh pages."""
    # pages used after: the sibling's 4 (the shared 2 among them) + its 2 or 4 fresh ones
    for how, want, used in (("own", 8, 6), ("all", 0, 4), ("new_weights", 0, 8)):
        scheduler = Scheduler(CONFIG, replicas=1, num_pages=32)
        first, second = _running_group(scheduler)
        scheduler.preempt(second)
        if how == "all":
            scheduler.release(first)
        if how == "new_weights":
            scheduler.forget_prefixes()  # `Engine.update_weights`, `Engine.sleep`
        else:
            _hand_out_free_pages(scheduler)
        [(slot, _, start)] = scheduler.readmit()
        assert start == want, how
        assert scheduler.recomputed == [12 - want], how  # positions start .. 11
        assert scheduler.pages.books[0].allocator.num_used == used, how


def test_siblings_share_the_prompt_pages_the_first_of_them_recomputes():
    """A whole group preempted, its pages handed out: the first sample back recomputes all 12
    positions (start 0, the prefill call); the second finds the prompt's 2 full pages it
    writes and recomputes only positions 8..11 (the extend call after it)."""
    scheduler = Scheduler(CONFIG, replicas=1, num_pages=32)
    for slot in _running_group(scheduler):
        scheduler.preempt(slot)
    _hand_out_free_pages(scheduler)
    done = scheduler.readmit()
    assert [start for _, _, start in done] == [0, 8]
    (a, _, _), (b, _, _) = done
    assert scheduler.slot_pages[a][:2] == scheduler.slot_pages[b][:2]
    assert scheduler.slot_pages[a][2:] != scheduler.slot_pages[b][2:]
    assert scheduler.recomputed == [12 + 4]
    assert scheduler.pages.books[0].allocator.num_used == 2 + 2 * 2


def test_a_sequence_comes_back_where_most_of_it_is_cached_else_least_loaded():
    """Two replicas, the group on replica 0: the preempted sample goes back to replica 0,
    where its 3 full pages are cached, though replica 1 holds nothing; once nothing is
    cached, to the least loaded replica with room (1), recomputed from 0."""
    scheduler = Scheduler(CONFIG, replicas=2, num_pages=32)
    first, second = _running_group(scheduler)
    scheduler.preempt(second)
    [(slot, _, start)] = scheduler.readmit()
    assert scheduler.replica_of(slot) == 0 and start == 12
    scheduler.preempt(slot)
    scheduler.forget_prefixes()
    [(slot, _, start)] = scheduler.readmit()
    assert scheduler.replica_of(slot) == 1 and start == 0
    assert scheduler.pages.books[1].allocator.num_used == 4


def test_pages_computed_before_new_weights_are_never_recorded():
    """New weights while the group runs (`Engine.update_weights` with the keys/values kept):
    a sample preempted afterwards records none of its pages, as all were computed before, and
    comes back recomputed from 0; pages allocated after the swap are recorded."""
    scheduler = Scheduler(CONFIG, replicas=1, num_pages=32)
    first, second = _running_group(scheduler)
    scheduler.forget_prefixes()
    scheduler.preempt(second)
    [(slot, _, start)] = scheduler.readmit()
    assert start == 0
    scheduler.preempt(slot)  # its pages now were allocated after the swap
    [(_, _, start)] = scheduler.readmit()
    assert start == 12


def test_a_sequence_that_fits_nowhere_holds_only_its_own_replica():
    """Two replicas of 12 pages. Replica 0 full: its two preempted samples (4 pages each,
    nothing cached) fit nowhere and wait; the younger sample of replica 1 (3 pages) still comes
    back there, and replica 1 admits a new group once it has pages, replica 0 none."""
    config = dataclasses.replace(CONFIG, max_num_seqs=4, watermark=0.0)
    scheduler = Scheduler(config, replicas=2, num_pages=12)
    a = _running_group(scheduler)  # replica 0: 6 pages
    b = _running_group(scheduler, prompt=tuple(t + 20 for t in PROMPT))  # replica 0: 6 more
    for slot in (b[1], a[1]):
        scheduler.preempt(slot)
    scheduler.forget_prefixes()
    scheduler.pages.books[0].allocator.allocate(4)  # replica 0 full again
    request = Request(tuple(t + 40 for t in PROMPT), SamplingParams(n=1, max_tokens=8), index=5)
    prefix = scheduler.pages.admit(request, 1)  # replica 1: a sequence of request 5
    pages = scheduler.pages.sample_pages(prefix)
    row = Row(token=5, position=9, max_tokens=8, pages=pages, temperature=1.0, top_k=0,
              top_p=1.0, seed=(0, 5, 0), stop_ids=())  # fmt: skip
    slot = scheduler.free_slots_of(1)[0]
    scheduler.assign(slot, row, len(PROMPT) + 8, request.prompt)
    scheduler.preempt(slot)
    assert [p.replica for p in scheduler.preempted] == [0, 0, 1]
    scheduler.pages.books[1].allocator.allocate(9)  # 3 left: request 5's 3, not the others' 4
    [(back, seq, _)] = scheduler.readmit()
    assert scheduler.replica_of(back) == 1 and seq.request_index == 5
    small = Request((1, 2, 3), SamplingParams(n=1, max_tokens=2), index=6)
    assert scheduler.place(small) is None  # replica 1 has no page left, replica 0 is held
    scheduler.release(back)
    assert scheduler.place(small) == 1


def test_readmission_waits_for_token_budget_after_the_first():
    """A budget of 14 tokens, two preempted samples recomputed from 0 (12 tokens each). The
    first comes back and decodes 2 tokens in the step's call: 14 - 12 - 2 = 0 left, so the
    second waits for the next engine step."""
    config = dataclasses.replace(CONFIG, max_num_batched_tokens=14, max_num_seqs=8)
    scheduler = Scheduler(config, replicas=1, num_pages=64)
    a = _running_group(scheduler)
    b = _running_group(scheduler, prompt=tuple(t + 20 for t in PROMPT))
    scheduler.preempt(a[1])
    scheduler.preempt(b[1])
    scheduler.release(a[0])
    scheduler.release(b[0])
    scheduler.forget_prefixes()  # recomputed from 0, each
    assert len(scheduler.preempted) == 2
    assert [start for _, _, start in scheduler.readmit()] == [0]
    assert scheduler.recomputed == [12] and scheduler.prefill_budgets() == [0]
    assert len(scheduler.preempted) == 1
    scheduler.grow_for_decode(2)  # the step's decode call: a new budget
    assert scheduler.recomputed == [0]
    assert [start for _, _, start in scheduler.readmit()] == [0]


def test_engine_readmits_on_shared_pages_and_samples_equal_an_unpreempted_run(eos_model, engine):
    """A pool of 8 pages: groups of 2 samples preempt each other; readmissions on cached
    pages (start > 0) happen, and the samples are those of the big pool."""
    small = Engine(eos_model, dataclasses.replace(ENGINE_CONFIG, num_pages=8))
    starts = []
    readmit = small.scheduler.readmit

    def spy(*args, **kwargs):
        done = readmit(*args, **kwargs)
        starts.extend(start for _, _, start in done)
        return done

    small.scheduler.readmit = spy
    prompts = make_prompts()
    params = SamplingParams(n=2, temperature=0.9, top_k=30, max_tokens=8, seed=11)
    got = generate(small, prompts, params)
    want = generate(engine, prompts, params)
    assert any(s > 0 for s in starts), starts
    np.testing.assert_array_equal(got.responses, want.responses)
    np.testing.assert_allclose(got.rollout_log_probs, want.rollout_log_probs, atol=1e-5)
    assert small.num_free_pages == small.num_pages and not small.preempted


def test_queued_page_copies_run_before_their_pages_are_freed(eos_model):
    """Samples inserted (the first's copy of the partial prompt page queued), then aborted or
    set aside before any decode call: the copy runs first, so it cannot land on the page's
    next holder, and every page comes back."""
    engine = Engine(eos_model, ENGINE_CONFIG)
    prompt = tuple(make_prompts()[4])  # 12 tokens: positions 0..10, the last page partial
    for index, leave in enumerate((engine.abort, engine.set_aside)):
        request = Request(prompt, SamplingParams(n=2, max_tokens=4), index)
        [prefix] = engine.prefill([request])
        for slot in engine.free_slots_of(0)[:2]:
            engine.insert(prefix, slot)
        assert engine.pages.books[0].copies
        if leave == engine.abort:
            assert len(leave({index})) == 2
        else:
            assert len(leave()) == 2
        assert not engine.pages.books[0].copies
        assert engine.num_free_pages == engine.num_pages and engine.num_active == 0
