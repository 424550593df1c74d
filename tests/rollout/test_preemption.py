"""Pages on demand with recompute preemption: a pool too small for the batch preempts, and the
samples equal those of an engine that never preempts; the page books of both allocation modes
against hand-counted pages; the victim is the youngest sequence."""

import dataclasses

import numpy as np
import pytest
from conftest import ENGINE_CONFIG
from rollout_testing import make_prompts

from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate
from hybridjax.rollout.pages import PageBook, Request, watermark_pages
from hybridjax.rollout.preemption import pages_to_grow, youngest
from hybridjax.rollout.slots import Row, Slots

PROMPTS = make_prompts()  # lengths 5, 9, 1, 4, 12, 7


@pytest.fixture(scope="module")
def small(eos_model):
    """4 slots of up to 6 pages each over a pool of 8 pages: the biggest group fits alone
    (prompt 12, n = 2, 8 new tokens: 3 + 2 × 3 - 1 = 8 pages), 4 running sequences do not."""
    return Engine(eos_model, dataclasses.replace(ENGINE_CONFIG, num_pages=8))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(n=2, temperature=0.9, top_k=30, max_tokens=8, seed=11),
    ],
    ids=["greedy", "sampled"],
)
def test_small_pool_preempts_and_samples_equal_an_unpreempted_run(small, engine, params):
    before_small, before_big = small.num_preemptions, engine.num_preemptions
    got = generate(small, PROMPTS, params)
    want = generate(engine, PROMPTS, params)  # 24 pages: every slot's worst case fits
    assert engine.num_preemptions == before_big
    assert small.num_preemptions > before_small
    np.testing.assert_array_equal(got.responses, want.responses)
    np.testing.assert_array_equal(got.response_mask, want.response_mask)
    np.testing.assert_allclose(got.rollout_log_probs, want.rollout_log_probs, atol=1e-5)
    assert got.finish_reason == want.finish_reason
    assert small.num_free_pages == small.num_pages and not small.preempted
    assert small.num_active == 0 and small.pages.books[0].reserved == 0


def _book(mode: str) -> PageBook:
    return PageBook(RolloutConfig(page_size=4, page_allocation=mode), 32)


def test_page_books_reserve_the_worst_case_or_only_the_prompt():
    """Prompt of 10 tokens, 4-token pages, n = 3, 6 new tokens: the prefill holds positions
    0..8 (2 full pages + 1 partial). "reserve": each sample takes pages up to position 14 at
    insertion (2 own + the partial or its copy) -> 2 + 3 × 2 = 8 pages. "on_demand": the prompt's
    3 pages + 2 copies of the partial page = 5; a sample at position 9 that will run 3 steps
    (positions 9..11) already holds page 2, one at position 12 needs page 3."""
    request = Request(tuple(range(1, 11)), SamplingParams(n=3, max_tokens=6))
    used = {}
    for mode in ("reserve", "on_demand"):
        book = _book(mode)
        prefix = book.admit(request)
        tables = [book.sample_pages(prefix) for _ in range(3)]
        used[mode] = book.allocator.num_used
        assert book.reserved == 0 and len(book.copies) == 2
        assert all(len(t) == (4 if mode == "reserve" else 3) for t in tables)
    assert used == {"reserve": 8, "on_demand": 5}

    slots = Slots.empty(1, 6)
    row = Row(token=1, position=9, max_tokens=6, pages=[0, 1, 2], temperature=0.0, top_k=0,
              top_p=1.0, seed=(0, 0, 0), stop_ids=())  # fmt: skip
    slots.assign(0, row)
    assert pages_to_grow(slots, 0, 3, held=3, page_size=4) == 0
    slots.position[0], slots.num_generated[0] = 12, 3
    assert pages_to_grow(slots, 0, 3, held=3, page_size=4) == 1
    slots.num_generated[0] = 5  # one token left: only position 12
    assert pages_to_grow(slots, 0, 8, held=3, page_size=4) == 1


def test_admission_keeps_the_watermark_free():
    """100 pages of 4 tokens, watermark 0.05: 5 pages. A prompt of 10 tokens (n = 1) takes its
    3 prefill pages at admission: admitted with 8 pages free (5 left), refused with 7 (4 left,
    below the watermark), while a running sequence may still grow into them; "reserve" keeps
    no watermark (its sequences never grow)."""
    assert watermark_pages(0.01, 384) == 3 and watermark_pages(0.01, 99) == 0
    request = Request(tuple(range(1, 11)), SamplingParams(n=1, max_tokens=6))
    book = PageBook(RolloutConfig(page_size=4, watermark=0.05), 100)
    assert book.watermark == 5 and book.admit_pages(10, request.params) == 3
    book.allocator.allocate(92)
    assert book.can_admit(request) and book.can_admit_pages(3)
    book.allocator.allocate(1)
    assert not book.can_admit(request) and not book.can_admit_pages(3)
    assert book.grow(3) is not None  # growth may use the watermark's pages
    reserve = PageBook(RolloutConfig(page_size=4, watermark=0.05, page_allocation="reserve"), 100)
    assert reserve.watermark == 0
    with pytest.raises(ValueError, match="watermark must be in"):
        RolloutConfig(watermark=1.0)


def test_a_watermark_preempts_less_and_samples_the_same(eos_model):
    """A pool of 10 pages (the biggest group takes 8): admitting only while 2 pages stay free
    preempts fewer running sequences than admitting into a nearly full pool; same samples."""
    params = SamplingParams(n=2, temperature=0.9, top_k=30, max_tokens=8, seed=11)
    outs, preemptions = [], []
    for watermark in (0.0, 0.2):
        config = dataclasses.replace(ENGINE_CONFIG, num_pages=10, watermark=watermark)
        engine = Engine(eos_model, config)
        assert engine.pages.books[0].watermark == int(10 * watermark)
        outs.append(generate(engine, PROMPTS, params))
        preemptions.append(engine.num_preemptions)
        assert engine.num_free_pages == engine.num_pages
    assert preemptions[1] < preemptions[0]
    np.testing.assert_array_equal(outs[1].responses, outs[0].responses)
    np.testing.assert_allclose(outs[1].rollout_log_probs, outs[0].rollout_log_probs, atol=1e-5)
    # a group that cannot leave the watermark free in an empty pool is rejected up front
    big = Request(tuple(PROMPTS[4]), params, 4)  # 8 pages + 2 > 9
    small = Engine(eos_model, dataclasses.replace(ENGINE_CONFIG, num_pages=9, watermark=0.25))
    with pytest.raises(ValueError, match="watermark of 2"):
        small.check_request(big)


def test_the_youngest_active_sequence_is_the_victim():
    slots = Slots.empty(4, 2)
    for slot, (index, sample) in enumerate([(3, 0), (5, 1), (5, 0), (9, 0)]):
        row = Row(token=1, position=0, max_tokens=4, pages=[], temperature=0.0, top_k=0,
                  top_p=1.0, seed=(0, index, sample), stop_ids=())  # fmt: skip
        slots.assign(slot, row)
    assert youngest(slots, np.arange(4)) == 3
    slots.active[3] = False
    assert youngest(slots, np.arange(4)) == 1  # request 5, sample 1 arrived after sample 0
    assert youngest(slots, np.array([0])) == 0
    slots.active[:] = False
    assert youngest(slots, np.arange(4)) is None


def test_unknown_page_allocation_is_rejected():
    with pytest.raises(ValueError, match="page_allocation 'lazy'.*on_demand"):
        RolloutConfig(page_allocation="lazy")


def test_config_keys_reach_the_engine_config_and_bad_values_are_named():
    from tests.reliability.test_config_checks import _config, _problems

    keys = {
        "actor_rollout_ref.rollout.page_allocation": "reserve",
        "actor_rollout_ref.rollout.max_num_batched_tokens": 64,
        "actor_rollout_ref.rollout.enable_chunked_prefill": False,
        "actor_rollout_ref.rollout.watermark": 0.05,
    }
    r = RolloutConfig.from_config(_config(**keys).actor_rollout_ref.rollout)
    got = (r.page_allocation, r.max_num_batched_tokens, r.enable_chunked_prefill, r.watermark)
    assert got == ("reserve", 64, False, 0.05)
    default = RolloutConfig.from_config(_config().actor_rollout_ref.rollout)
    assert (default.page_allocation, default.max_num_batched_tokens) == ("on_demand", 8192)
    assert default.watermark == 0.01
    assert "actor_rollout_ref.rollout.watermark: must be in [0, 1)" in _problems(
        **{"actor_rollout_ref.rollout.watermark": 1.0}
    )
    bad = _problems(**{"actor_rollout_ref.rollout.page_allocation": "lazy"})
    assert "actor_rollout_ref.rollout.page_allocation: one of ('on_demand', 'reserve')" in bad
    assert "max_num_batched_tokens" in _problems(
        **{"actor_rollout_ref.rollout.max_num_batched_tokens": 0}
    )
