"""Decode over the active slots only: batch sizes, the slot table's gather/scatter, and an engine
with a pool far larger than its batch against a slot-free reference."""

import numpy as np
import pytest
from rollout_testing import make_prompts, naive_sample

from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate
from hybridjax.rollout.slots import Row, Slots, decode_batch_size


def test_decode_batch_size_is_a_bounded_set_of_powers_of_two():
    sizes = {decode_batch_size(n, 256) for n in range(1, 257)}
    assert sizes == {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert all(n <= decode_batch_size(n, 256) < 2 * n for n in range(1, 257))
    assert decode_batch_size(3, 256, multiple=4) == 4  # rows split over a data axis of 4
    assert decode_batch_size(20, 24) == 24  # capped at max_num_seqs
    assert decode_batch_size(5, 256) == 8


def _row(token: int, pages: list[int]) -> Row:
    return Row(token=token, position=token + 1, max_tokens=9, pages=pages, temperature=0.5,
               top_k=3, top_p=0.9, seed=(1, token, 0), stop_ids=(7,))  # fmt: skip


def test_take_pads_with_inactive_rows_and_put_scatters_back():
    slots = Slots.empty(6, 4)
    slots.assign(4, _row(40, [5, 6, 7]))
    slots.assign(1, _row(10, [2]))
    rows = np.flatnonzero(slots.active)
    batch = slots.take(rows, 4, width=2)
    assert rows.tolist() == [1, 4]
    assert batch.token.tolist() == [10, 40, 0, 0]
    assert batch.active.tolist() == [True, True, False, False]
    assert batch.page_table.tolist() == [[2, 0], [5, 6], [0, 0], [0, 0]]
    assert batch.top_p.tolist() == pytest.approx([0.9, 0.9, 1.0, 1.0])
    assert batch.stop_ids[:, 0].tolist() == [7, 7, -1, -1]
    assert batch.temperature[2:].tolist() == [0.0, 0.0]  # padding rows are greedy
    advanced = dict(token=np.array([11, 41, 99, 99]), active=np.array([True, False, True, True]))
    after = slots.put(rows, advanced)
    assert after.token.tolist() == [0, 11, 0, 0, 41, 0]
    assert after.active.tolist() == [False, True, False, False, False, False]
    assert slots.token[1] == 10  # put returns new arrays


@pytest.fixture(scope="module")
def big_pool(eos_model):
    """64 slots, one decode call per response (8 steps), so each batch size runs one shape."""
    config = RolloutConfig(
        page_size=4, max_num_seqs=64, prompt_length=16, response_length=8, decode_steps_per_call=8
    )
    return Engine(eos_model, config)


@pytest.mark.parametrize("num_prompts, n, rows", [(1, 1, 1), (3, 2, 8), (6, 3, 32)])
def test_a_large_pool_decodes_only_the_active_rows(
    big_pool, engine, eos_model, num_prompts, n, rows
):
    """Samples (top-p, temperature) of 1, 6 and 18 sequences on 64 slots: decode batches of 1, 8
    and 32 rows, tokens and log-probs equal to a slot-free reference and to the 4-slot engine
    (which refills its slots as sequences finish)."""
    prompts = make_prompts()[:num_prompts]
    sp = SamplingParams(n=n, temperature=0.8, top_p=0.9, max_tokens=6, ignore_eos=True, seed=n)
    steps, row_steps = big_pool.num_decode_steps, big_pool.num_decode_rows
    out = generate(big_pool, prompts, sp)
    assert big_pool.num_decode_steps - steps == 6
    assert big_pool.num_decode_rows - row_steps == 6 * rows  # not 6 × 64
    assert any(k.startswith(f"decode(rows={rows},") for k in big_pool.compile_counts)
    for i, prompt in enumerate(prompts):
        for j in range(n):
            tokens, log_probs = naive_sample(eos_model, prompt, sp, i, j)
            assert out.responses[i * n + j].tolist() == tokens
            np.testing.assert_allclose(out.rollout_log_probs[i * n + j], log_probs, atol=1e-5)
    small = generate(engine, prompts, sp)
    np.testing.assert_array_equal(small.responses, out.responses)
    np.testing.assert_allclose(small.rollout_log_probs, out.rollout_log_probs, atol=1e-5)
    assert big_pool.num_free_pages == big_pool.num_pages


def test_decode_shapes_stay_bounded_as_sequences_finish(big_pool):
    """Responses of 1 .. 8 tokens (EOS ignored) from 12 sequences, 2 decode steps per call: the
    decode batch shrinks at the host round trips as they finish: 12 active (16 rows), then 8
    and 6 (8 rows), then 4 (4 rows)."""
    params = [SamplingParams(n=2, temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (8, 1, 3, 5, 2, 7)]  # fmt: skip
    config = big_pool.config
    big_pool.config = RolloutConfig(**{**config.__dict__, "decode_steps_per_call": 2})
    try:
        out = generate(big_pool, make_prompts(), params)
    finally:
        big_pool.config = config
    assert out.response_mask.sum(1).tolist() == [8, 8, 1, 1, 3, 3, 5, 5, 2, 2, 7, 7]
    decode = [k for k in big_pool.compile_counts if k.startswith("decode(") and "steps=2" in k]
    sizes = {int(k.split("rows=")[1].split(",")[0]) for k in decode}
    assert sizes == {16, 8, 4}, decode
