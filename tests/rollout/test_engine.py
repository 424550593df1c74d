"""The engine end to end against the full forward: greedy, continuous batching, shared prompt
pages, log-probs, seeds, stop conditions, request rejection."""

import jax
import numpy as np
import pytest
from rollout_testing import make_prompts, naive_greedy, trainer_log_probs

from hybridjax.errors import ConfigError
from hybridjax.rollout import Request, SamplingParams, generate
from hybridjax.rollout.sampling import truncate_logits

PROMPTS = make_prompts()  # lengths 5, 9, 1, 4, 12, 7


def _assert_idle(engine):
    assert engine.num_active == 0
    assert engine.num_free_pages == engine.num_pages
    assert engine.pages.books[0].reserved == 0


def _rows(out):
    """Each row's response as a list (mask applied)."""
    return [
        r[m.astype(bool)].tolist() for r, m in zip(out.responses, out.response_mask, strict=True)
    ]


def test_greedy_equals_naive_loop_over_full_forward(engine, eos_model):
    out = generate(engine, PROMPTS, SamplingParams(n=2, temperature=0.0, max_tokens=6))
    eos = engine.eos_ids
    expect = [naive_greedy(eos_model, p, 6, eos) for p in PROMPTS for _ in range(2)]
    assert _rows(out) == expect
    assert out.finish_reason == tuple("stop" if e[-1] in eos else "length" for e in expect)
    assert out.responses.shape == (12, 6) and out.responses.dtype == np.int32
    assert np.all(out.responses[out.response_mask == 0] == 0)
    _assert_idle(engine)


def test_continuous_batching_equals_one_request_at_a_time(engine):
    # Per-prompt max_tokens so sequences finish at different steps and slots get refilled.
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (7, 2, 5, 8, 3, 6)
    ]
    together = generate(engine, PROMPTS, params)
    alone = [generate(engine, [p], [sp]) for p, sp in zip(PROMPTS, params, strict=True)]
    assert _rows(together) == [_rows(a)[0] for a in alone]
    static = generate(engine, PROMPTS, params, continuous=False)
    assert _rows(static) == _rows(together)
    assert [len(r) for r in _rows(together)] == [7, 2, 5, 8, 3, 6]
    assert together.finish_reason == ("length",) * 6
    _assert_idle(engine)


def test_sampled_tokens_do_not_depend_on_slot_placement_or_chunking(engine):
    """Continuous vs static batching place samples in other slots and stop the decode loop at
    other steps; each sample's PRNG stream depends only on (seed, prompt, sample, step)."""
    sp = SamplingParams(n=3, temperature=0.8, top_k=20, top_p=0.9, max_tokens=8, seed=3)
    a = generate(engine, PROMPTS[:4], sp)
    b = generate(engine, PROMPTS[:4], sp, continuous=False)
    np.testing.assert_array_equal(a.responses, b.responses)
    np.testing.assert_allclose(a.rollout_log_probs, b.rollout_log_probs, atol=1e-6)
    _assert_idle(engine)


def test_prompt_pages_are_shared_across_samples(engine):
    """Prompt of 10 tokens, 4-token pages, 6 new tokens, n = 3: the prefill holds positions 0..8
    (2 full pages + 1 partial page); each sample holds positions up to 14 (4 pages, 2 of them
    shared). Shared: 2 + 3 × 2 = 8 pages. Unshared (3 separate prompts): 3 × 4 = 12."""
    prompt = tuple(make_prompts((10,), seed=7)[0])
    sp = SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True)
    assert engine.pages.books[0].group_pages(10, sp) == 8

    def run(requests):
        prefixes = engine.prefill(requests)
        slot = 0
        for prefix in prefixes:
            while prefix.samples_left:
                engine.insert(prefix, slot)
                slot += 1
        used = engine.allocators[0].num_used
        copies = len(engine.pages.books[0].copies)
        tokens = [[] for _ in range(slot)]
        while engine.num_active:
            step = engine.generate(num_steps=engine.config.decode_steps_per_call)
            used = max(used, engine.allocators[0].num_used)  # on demand: the peak at the end
            for s in range(slot):
                tokens[s] += [t for t in step.tokens[s] if t >= 0]
        for s in range(slot):
            engine.free_resource(s)
        return tokens, used, copies

    shared, used_shared, copies = run([Request(prompt, sp)])
    single = SamplingParams(n=1, temperature=0.0, max_tokens=6, ignore_eos=True)
    unshared, used_unshared, _ = run([Request(prompt, single, i) for i in range(3)])
    assert (used_shared, used_unshared) == (8, 12)
    assert copies == 2  # the last sample takes the prefill's partial page itself
    assert shared == unshared
    assert all(len(t) == 6 for t in shared)
    _assert_idle(engine)


def test_log_probs_equal_trainer_log_probs_with_temperature(engine, eos_model):
    out = generate(engine, PROMPTS, SamplingParams(n=2, temperature=0.7, max_tokens=8, seed=5))
    for row, resp in enumerate(_rows(out)):
        expect = trainer_log_probs(eos_model, PROMPTS[row // 2], resp, 0.7)
        np.testing.assert_allclose(out.rollout_log_probs[row, : len(resp)], expect, atol=1e-5)
    assert np.all(out.rollout_log_probs[out.response_mask == 0] == 0)
    # Greedy rows report log-probs at temperature 1.
    greedy = generate(engine, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4))
    for row, resp in enumerate(_rows(greedy)):
        expect = trainer_log_probs(eos_model, PROMPTS[row], resp, 1.0)
        np.testing.assert_allclose(greedy.rollout_log_probs[row, : len(resp)], expect, atol=1e-5)


def test_top_k_log_probs_are_renormalised_over_the_kept_tokens(engine, eos_model):
    sp = SamplingParams(n=2, temperature=0.9, top_k=3, max_tokens=5, ignore_eos=True, seed=1)
    out = generate(engine, PROMPTS[:3], sp)
    from rollout_testing import full_logits

    for row, resp in enumerate(_rows(out)):
        prompt = PROMPTS[row // 2]
        logits = full_logits(eos_model, prompt + resp)[len(prompt) - 1 : -1] / 0.9
        kept = truncate_logits(logits, np.full(len(resp), 3), np.ones(len(resp), np.float32))
        assert np.all(np.isfinite(np.take_along_axis(kept, np.array(resp)[:, None], 1)))
        expect = np.take_along_axis(jax.nn.log_softmax(kept), np.array(resp)[:, None], 1)[:, 0]
        np.testing.assert_allclose(out.rollout_log_probs[row, : len(resp)], expect, atol=1e-5)


def test_seed_reproducibility(engine):
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=8, ignore_eos=True, seed=11)
    a = generate(engine, PROMPTS[:3], sp)
    b = generate(engine, PROMPTS[:3], sp)
    c = generate(engine, PROMPTS[:3], SamplingParams(**{**sp.__dict__, "seed": 12}))
    np.testing.assert_array_equal(a.responses, b.responses)
    assert not np.array_equal(a.responses, c.responses)
    assert not np.array_equal(a.responses[0], a.responses[1])  # samples of one prompt differ


def test_eos_stop_ids_and_max_tokens(engine, eos_model):
    eos = engine.eos_ids[0]
    stops = generate(engine, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8))
    assert _rows(stops)[0][3] == eos and len(_rows(stops)[0]) == 4
    assert stops.finish_reason == ("stop",)
    assert stops.response_mask[0].tolist() == [1] * 4 + [0] * 4

    runs_on = generate(
        engine, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    full = _rows(runs_on)[0]
    assert len(full) == 8 and full[:4] == _rows(stops)[0]
    assert runs_on.finish_reason == ("length",)

    stop_id = full[5]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=(stop_id,))
    by_id = _rows(generate(engine, PROMPTS[:1], sp))[0]
    assert by_id == full[: full.index(stop_id) + 1]
    _assert_idle(engine)


def test_left_padded_array_equals_token_lists(engine):
    prompts = PROMPTS[:3]
    width = max(map(len, prompts))
    ids = np.zeros((3, width), np.int32)
    mask = np.zeros((3, width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    a = generate(engine, ids, sp, attention_mask=mask)
    b = generate(engine, prompts, sp)
    np.testing.assert_array_equal(a.responses, b.responses)


def test_requests_that_can_never_fit_are_rejected_with_sizes(engine):
    with pytest.raises(ValueError, match=r"prompt of 20 tokens \+ max_tokens 8 exceeds .* 24"):
        generate(engine, [[1] * 20], SamplingParams(max_tokens=8))
    # 12-token prompt, 8 new tokens, n = 8: 3 prefill pages + 8 × 3 - 1 = 26 > 24 in the pool.
    with pytest.raises(ConfigError, match="needs 26 KV pages .* pool has 24"):  # one line
        generate(engine, [[1] * 12], SamplingParams(n=8, max_tokens=8))
    _assert_idle(engine)


def test_compiles_stay_few(engine):
    """After the tests above: prefill buckets (batch 1/2/4 × length 16), decode variants (decode
    batch 1/2/4 × with and without top-k/p × page-table widths 2/4/6), one page-copy bucket."""
    generate(engine, PROMPTS, SamplingParams(n=2, temperature=0.0, max_tokens=6))
    decode = [k for k in engine.compile_counts if k.startswith("decode")]
    assert {k.split(",")[0] for k in decode} <= {"decode(rows=1", "decode(rows=2", "decode(rows=4"}
    assert len(decode) <= 3 * 2 * 3 and engine.num_compiles <= 24, engine.compile_counts
    before = engine.num_compiles
    generate(engine, PROMPTS, SamplingParams(n=2, temperature=0.5, max_tokens=6))
    assert engine.num_compiles == before
