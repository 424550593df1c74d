"""Chunked prefill under `max_num_batched_tokens`: long prompts prefilled over several engine
steps (later chunks on top of the cached earlier ones) give the samples of whole-prompt
prefill; without chunking, prompts wait whole for a step with room."""

import dataclasses

import numpy as np
import pytest
from conftest import ENGINE_CONFIG
from rollout_testing import make_prompts

from hybridjax.rollout import Engine, SamplingParams, generate
from hybridjax.rollout.pages import Request, chunk_sizes

PROMPTS = make_prompts()  # lengths 5, 9, 1, 4, 12, 7: 4, 8, 0, 3, 11, 6 prefilled positions


def test_chunk_sizes_by_hand():
    assert chunk_sizes([11, 4, 6], 5, chunked=True) == [5, 0, 0]
    assert chunk_sizes([1, 4, 6], 8, chunked=True) == [1, 4, 3]
    assert chunk_sizes([0, 3, 6], 8, chunked=True) == [0, 3, 5]  # a finished one is skipped
    assert chunk_sizes([11, 4], 5, chunked=False) == [11, 0]  # the first runs whole
    assert chunk_sizes([3, 6, 1], 8, chunked=False) == [3, 0, 0]  # FCFS: 6 waits, so does 1
    assert chunk_sizes([3, 4, 1], 8, chunked=False) == [3, 4, 1]


@pytest.fixture(scope="module")
def budgeted(eos_model):
    """5 prompt tokens per engine step: the 12-token prompt is prefilled in 3 chunks."""
    return Engine(eos_model, dataclasses.replace(ENGINE_CONFIG, max_num_batched_tokens=5))


def test_chunks_spend_the_budget_in_order_and_continue_where_they_stopped(budgeted):
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    prefixes = [budgeted.admit(Request(tuple(PROMPTS[i]), sp, i)) for i in (4, 0)]
    assert budgeted.run_prefill(prefixes, 5) == 5  # 5 of the first prompt's 11
    assert [p.prefilled for p in prefixes] == [5, 0]
    assert budgeted.run_prefill(prefixes, 5) == 5
    assert budgeted.run_prefill(prefixes, 5) == 5  # the last 1, then 4 of the second prompt
    assert [p.to_prefill for p in prefixes] == [0, 0]
    third = budgeted.admit(Request(tuple(PROMPTS[1]), sp, 1))
    with pytest.raises(ValueError, match="not fully prefilled"):
        budgeted.insert(third, 0)
    budgeted.run_prefill([third])  # no budget: whole
    for slot, prefix in enumerate([*prefixes, third]):
        budgeted.insert(prefix, slot)
        budgeted.free_resource(slot)
    assert budgeted.num_free_pages == budgeted.num_pages


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_budgeted_prefill_gives_the_samples_of_whole_prefill(budgeted, engine, chunked):
    budgeted.config = dataclasses.replace(budgeted.config, enable_chunked_prefill=chunked)
    for sp in (
        SamplingParams(n=2, temperature=0.0, max_tokens=6),
        SamplingParams(n=2, temperature=0.8, top_p=0.9, max_tokens=6, seed=2),
    ):
        got, want = generate(budgeted, PROMPTS, sp), generate(engine, PROMPTS, sp)
        np.testing.assert_array_equal(got.responses, want.responses)
        np.testing.assert_allclose(got.rollout_log_probs, want.rollout_log_probs, atol=1e-5)
        assert got.finish_reason == want.finish_reason
        assert budgeted.num_free_pages == budgeted.num_pages
    # chunks after the first run as extensions of the cached prefix; whole prompts never do
    assert any(k.startswith("extend") for k in budgeted.compile_counts) or not chunked


def test_chunk_sizes_after_decode_tokens_by_hand():
    # 6 of 10 tokens left after the decodes: chunked takes them, whole prompts wait for a
    # step with room (no overrun while decodes spent part of the budget)
    assert chunk_sizes([11, 4], 6, chunked=True, overrun=False) == [6, 0]
    assert chunk_sizes([11, 4], 6, chunked=False, overrun=False) == [0, 0]
    assert chunk_sizes([4, 11], 6, chunked=False, overrun=False) == [4, 0]
    assert chunk_sizes([11, 4], 0, chunked=True, overrun=False) == [0, 0]
    assert chunk_sizes([11, 4], 10, chunked=False, overrun=True) == [11, 0]


def test_decode_tokens_of_the_step_come_off_the_prefill_budget(budgeted):
    """max_num_batched_tokens = 10, 3 decode steps per call: a running sequence with 8 tokens
    left computes 3 tokens in the next call, one with 1 token left computes 1, so 10 - 3 - 1 =
    6 prompt tokens remain: a chunk of 6 of an 11-token prefill, or (chunking off) none, the
    prompt waiting whole until no decode runs (then it overruns the budget, as the first)."""
    config = budgeted.config
    budgeted.config = dataclasses.replace(config, max_num_batched_tokens=10)
    try:
        assert budgeted.prefill_budgets() == [10]  # nothing runs
        long, short = (SamplingParams(temperature=0.0, max_tokens=m) for m in (8, 1))
        a = budgeted.admit(Request(tuple(PROMPTS[0]), long, 0))
        b = budgeted.admit(Request(tuple(PROMPTS[3]), short, 3))
        budgeted.run_prefill([a, b])
        budgeted.insert(a, 0)
        budgeted.insert(b, 1)
        assert budgeted.prefill_budgets() == [6]
        c = budgeted.admit(Request(tuple(PROMPTS[4]), long, 4))  # 11 positions to prefill
        budgeted.config = dataclasses.replace(budgeted.config, enable_chunked_prefill=False)
        assert budgeted.run_prefill([c], budgeted.prefill_budgets()) == 0
        budgeted.config = dataclasses.replace(budgeted.config, enable_chunked_prefill=True)
        assert budgeted.run_prefill([c], budgeted.prefill_budgets()) == 6
        budgeted.slots.active[1] = False  # the short one stopped: 10 - 3 left
        assert budgeted.prefill_budgets() == [7]
        budgeted.free_resource(0)
        budgeted.free_resource(1)
        assert budgeted.prefill_budgets() == [10]
        assert budgeted.run_prefill([c], budgeted.prefill_budgets()) == 5
        budgeted.insert(c, 2)
        budgeted.free_resource(2)
        assert budgeted.num_free_pages == budgeted.num_pages
    finally:
        budgeted.config = config
