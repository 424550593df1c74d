"""Partial rollouts on the tiny engine: a group still running when a batch is full carries
over, its tokens after the weight swap are sampled (and their log-probs taken) under the new
weights, each token records its version, the staleness bound regenerates old groups, and a
validation rollout in between leaves the carried sequences intact."""

import dataclasses
import json

import numpy as np
import pytest
from conftest import ENGINE_CONFIG
from flax import nnx
from rollout_testing import TINY, make_model, make_prompts, naive_greedy, trainer_log_probs

from hybridjax.algorithms.config import AlgorithmConfig
from hybridjax.algorithms.rollout_correction import compute_rollout_importance_weights
from hybridjax.rl.async_rollout import oldest, staleness_metrics
from hybridjax.rl.partial_rollout import PartialRollout, is_stale
from hybridjax.rollout import Engine, SamplingParams, generate

ROLLOUT = dict(n=2, do_sample=False, response_length=8)  # greedy: each sample is known


def _prompts(prompts, first=0):
    """A collated batch (`hybridjax.data`'s keys that matter) of token lists, left-padded;
    `ground_truth` tags each prompt with its index in `make_prompts()`."""
    width = ENGINE_CONFIG.prompt_length
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    tags = [f"p{first + i}" for i in range(len(prompts))]
    return {"input_ids": ids, "attention_mask": mask, "ground_truth": tags}


@pytest.fixture()
def setup(eos_model):
    """(own engine: its weights get swapped, PartialRollout, weights of version 1)."""
    engine = Engine(eos_model, ENGINE_CONFIG)
    stream = PartialRollout(engine, ROLLOUT, 0, 0, None, threshold=1)
    other = make_model(dataclasses.replace(TINY, eos_token_id=eos_model.config.eos_token_id), 1)
    return engine, stream, other


def _first_round(stream, eos_model):
    """Round 1 on prompts 0 (stops after 4 tokens) and 1 (runs to 8): hands over prompt 0,
    prompt 1 carries over part-way."""
    eos = eos_model.config.eos_token_id
    prompts = make_prompts()[:2]
    lengths = [len(naive_greedy(eos_model, p, 8, (eos,))) for p in prompts]
    assert lengths == [4, 8]
    stream.add(_prompts(prompts), step=1)
    got, out, versions = stream.take(step=1, count=1)
    assert got["ground_truth"] == ["p0"]
    np.testing.assert_array_equal(versions[:, :4], 0)
    np.testing.assert_array_equal(versions[:, 4:], -1)
    carried = stream.groups[1]
    assert 0 < len(carried.tokens[0]) < 8 and not carried.finished
    return len(carried.tokens[0])


def test_a_running_group_carries_over_and_continues_under_the_new_weights(setup, eos_model):
    engine, stream, other = setup
    before = _first_round(stream, eos_model)
    stream.set_weights(nnx.state(other), version=1)  # the update of step 1
    assert stream.num_recomputed == 2  # both samples of prompt 1 re-prefilled
    got, out, versions = stream.take(step=2, count=1)
    assert got["ground_truth"] == ["p1"]
    prompt = make_prompts()[1]
    old = naive_greedy(eos_model, prompt, before)
    new = naive_greedy(other, prompt + old, 8 - before)  # the new weights, from the prefix
    for row in range(2):
        np.testing.assert_array_equal(out.responses[row], old + new)
        np.testing.assert_array_equal(versions[row], [0] * before + [1] * (8 - before))
        want = np.concatenate(
            [
                trainer_log_probs(eos_model, prompt, old + new, 1.0)[:before],
                trainer_log_probs(other, prompt, old + new, 1.0)[before:],
            ]
        )
        np.testing.assert_allclose(out.rollout_log_probs[row], want, atol=1e-5)
    # the truncated IS weight of each token corrects its own lag: π_old (the new weights)
    # over the policy that sampled it: 1 after the swap, e^(Δ log p) ∧ 2 before
    pi_old = trainer_log_probs(other, prompt, old + new, 1.0)[None]
    config = AlgorithmConfig(rollout_is=True, rollout_is_threshold=2.0)
    weights = np.asarray(
        compute_rollout_importance_weights(
            pi_old, out.rollout_log_probs[:1], out.response_mask[:1], config
        )[0]
    )[0]
    np.testing.assert_allclose(weights[before:], 1.0, atol=1e-5)
    lag_ratio = np.exp(pi_old[0, :before] - trainer_log_probs(eos_model, prompt, old, 1.0))
    np.testing.assert_allclose(weights[:before], np.minimum(lag_ratio, 2.0), rtol=1e-5)
    assert np.any(np.abs(lag_ratio - 1) > 1e-2)  # the old tokens do lag
    np.testing.assert_array_equal(oldest(versions), [0, 0])
    m = staleness_metrics(oldest(versions), 2, versions)
    assert m["async/staleness_max"] == 1 and m["async/partial_fraction"] == 1.0
    assert m["async/staleness_mean"] == pytest.approx(before / 8)
    assert engine.num_active == 0 and not engine.preempted


def test_a_group_past_the_bound_is_generated_again_with_the_current_weights(setup, eos_model):
    engine, stream, other = setup
    _first_round(stream, eos_model)
    stream.set_weights(nnx.state(other), version=2)
    assert is_stale(0, step=3, threshold=1) and not is_stale(0, step=2, threshold=1)
    got, out, versions = stream.take(step=3, count=1)  # version 0 lags step 3 by 2 > 1
    assert stream.num_regenerated == 1 and got["ground_truth"] == ["p1"]
    eos = eos_model.config.eos_token_id
    want = naive_greedy(other, make_prompts()[1], 8, (eos,))
    np.testing.assert_array_equal(out.responses[0, : len(want)], want)
    assert set(versions[0, : len(want)]) == {2}
    assert engine.num_active == 0 and not engine.preempted


def test_a_rollout_in_between_leaves_the_carried_sequences_as_they_were(setup, eos_model):
    engine, stream, other = setup
    _first_round(stream, eos_model)
    with stream.paused():  # validation with other weights
        engine.update_weights(nnx.state(other))
        generate(engine, make_prompts()[3:5], SamplingParams(n=1, temperature=0.0, max_tokens=8))
    got, out, versions = stream.take(step=2, count=1)  # same version: no swap
    want = naive_greedy(eos_model, make_prompts()[1], 8)
    np.testing.assert_array_equal(out.responses[0], want)
    np.testing.assert_array_equal(versions, 0)


@pytest.mark.parametrize("same_weights", [True, False], ids=["same", "other"])
def test_keep_swaps_the_weights_without_a_prefill(setup, eos_model, same_weights):
    """`trainer.partial_rollout_kv="keep"`: at the swap the running samples keep their pages
    and go on decoding under the new weights, so nothing is prefilled again and the versions
    are recorded as with "recompute"; under the same weights as a new version the samples and
    log-probs are exactly those of a run that never swapped."""
    engine, _, other = setup
    stream = PartialRollout(engine, ROLLOUT, 0, 0, None, threshold=1, kv="keep")
    before = _first_round(stream, eos_model)
    prefilled = engine.num_prefill_tokens
    stream.set_weights(nnx.state(eos_model if same_weights else other), version=1)
    got, out, versions = stream.take(step=2, count=1)
    assert got["ground_truth"] == ["p1"]
    assert stream.num_recomputed == 0 and engine.num_prefill_tokens == prefilled
    prompt = make_prompts()[1]
    want = naive_greedy(eos_model, prompt, 8)
    for row in range(2):
        np.testing.assert_array_equal(versions[row], [0] * before + [1] * (8 - before))
        if same_weights:
            np.testing.assert_array_equal(out.responses[row], want)
            expect = trainer_log_probs(eos_model, prompt, want, 1.0)
            np.testing.assert_allclose(out.rollout_log_probs[row], expect, atol=1e-5)


def test_an_unknown_kv_mode_is_refused(eos_model):
    with pytest.raises(ValueError, match="partial_rollout_kv='reuse'.*'recompute' or 'keep'"):
        PartialRollout(Engine(eos_model, ENGINE_CONFIG), ROLLOUT, 0, 0, None, 1, kv="reuse")


def _rounds(stream, other, first: int, last: int, count: int = 2) -> list:
    """Rounds `first` .. `last` of a stream whose weights after round 1 are `other`'s."""
    out = []
    for step in range(first, last + 1):
        stream.set_weights(nnx.state(other), version=1)
        got, rows, versions = stream.take(step=step, count=count)
        out.append((got["ground_truth"], rows.responses, rows.rollout_log_probs, versions))
    return out


def test_the_prompts_in_flight_resume_from_their_record_as_if_never_stopped(eos_model):
    """Sampled, 6 prompts × 2 samples on 4 slots: after round 1 some groups are finished and
    not handed over, some run part-way, some wait in the queue. The record of round 1, through
    JSON (as a checkpoint stores it), loaded into a new stream on the engine, idle again with
    the weights of round 1, gives rounds 2 and 3 equal to the uninterrupted stream's: tokens,
    log-probs, versions, and the same prompt left in flight."""
    rollout = dict(n=2, do_sample=True, temperature=1.0, response_length=8)
    other = make_model(dataclasses.replace(TINY, eos_token_id=eos_model.config.eos_token_id), 1)
    engine = Engine(eos_model, ENGINE_CONFIG)
    stream = PartialRollout(engine, rollout, 0, 0, None, threshold=1)
    stream.add(_prompts(make_prompts()[:6]), step=1)
    stream.take(step=1, count=1)
    record = json.loads(json.dumps(stream.state_after(1)))
    tokens = [sum(map(len, g["tokens"])) for g in record["groups"]]
    assert len(record["groups"]) == 5 and 0 in tokens and max(tokens) > 0
    want = _rounds(stream, other, 2, 3)
    assert engine.num_active == 0 and not engine.preempted
    engine.update_weights(nnx.state(eos_model))
    resumed = PartialRollout(engine, rollout, 0, 0, None, threshold=1)
    resumed.load_state(record)
    got = _rounds(resumed, other, 2, 3)
    for (tags, responses, log_probs, versions), (tags2, r2, lp2, v2) in zip(want, got, strict=True):
        assert tags == tags2
        np.testing.assert_array_equal(responses, r2)
        np.testing.assert_array_equal(versions, v2)
        np.testing.assert_allclose(log_probs, lp2, atol=1e-6)
    assert resumed.groups.keys() == stream.groups.keys() == {5}


def test_prompts_in_flight_sampled_with_other_settings_are_generated_again(eos_model, caplog):
    """A run resumed with another `rollout.n` (or length, temperature...) than its checkpoint's
    prompts in flight were sampled with: those prompts are generated again with this config's
    settings, with a warning (issue 48's third probe, P12b: n=2 → 4)."""
    rollout = dict(n=2, do_sample=True, temperature=1.0, response_length=8)
    engine = Engine(eos_model, ENGINE_CONFIG)
    stream = PartialRollout(engine, rollout, 0, 0, None, threshold=1)
    stream.add(_prompts(make_prompts()[:6]), step=1)
    stream.take(step=1, count=1)
    record = json.loads(json.dumps(stream.state_after(1)))
    assert any(sum(map(len, g["tokens"])) for g in record["groups"])  # some started
    engine = Engine(eos_model, ENGINE_CONFIG)
    resumed = PartialRollout(engine, dict(rollout, n=4), 0, 0, None, threshold=1)
    with caplog.at_level("WARNING"):
        resumed.load_state(record)
    assert "5 prompts in flight" in caplog.text and "(n changed since)" in caplog.text, caplog.text
    got, rows, _ = resumed.take(step=2, count=2)
    assert rows.responses.shape[0] == 2 * 4
    assert all(len(g.tokens) == 4 for g in resumed.groups.values())
