"""Parity mode (`ModelConfig.batch_invariant`): the engine's log-prob of each sampled token
equals the trainer's old_log_prob pass bit for bit, for sequences that were chunk-prefilled,
preempted and readmitted on cached prefix pages, in float32 and bfloat16; and with top-p /
top-k sampling, over the truncated support the trainer replays (`rollout_logit_threshold`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ENGINE_CONFIG
from rollout_testing import TINY, make_model, make_prompts

from hybridjax.rollout import Engine, SamplingParams, generate
from hybridjax.training.batch import make_batch
from hybridjax.training.forward import model_log_probs

# 8 pages of 4 tokens for 4 slots: groups preempt each other and come back on cached pages;
# 5 prompt tokens per step: the longer prompts are prefilled in chunks (extend calls).
CONFIG = dataclasses.replace(ENGINE_CONFIG, num_pages=8, max_num_batched_tokens=5)


def trainer_log_probs(
    model, prompts, out, n: int, temperature: float, replay: bool = False
) -> np.ndarray:
    """The trainer's log-probs of the rollout's responses: one padded batch (left-padded
    prompts ++ right-padded responses) through `model_log_probs`, all rows in one call;
    with `replay`, over each token's sampled support (the rollout's thresholds)."""
    width = max(map(len, prompts))
    rows = [p for p in prompts for _ in range(n)]
    ids = np.array([[0] * (width - len(p)) + list(p) for p in rows], np.int32)
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in rows], np.int32)
    batch = make_batch(
        jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(out.responses),
        jnp.asarray(out.response_mask),
    )  # fmt: skip
    fields = {
        "input_ids": jnp.concatenate([batch.prompts, batch.responses], axis=1),
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "responses": batch.responses,
    }
    if replay:
        fields["rollout_logit_threshold"] = jnp.asarray(out.rollout_logit_threshold)
    score = jax.jit(lambda f: model_log_probs(model, f, temperature)[0])
    return np.asarray(score(fields))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_log_probs_equal_the_trainers_through_preemption_and_chunks(dtype):
    model = make_model(dataclasses.replace(TINY, dtype=dtype, batch_invariant=True))
    engine = Engine(model, CONFIG)
    starts: list[int] = []
    readmit = engine.scheduler.readmit

    def spy(*args, **kwargs):
        done = readmit(*args, **kwargs)
        starts.extend(start for _, _, start in done)
        return done

    engine.scheduler.readmit = spy
    prompts = make_prompts()
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3)
    out = generate(engine, prompts, params)
    assert engine.num_preemptions > 0 and any(s > 0 for s in starts), starts
    assert any(name.startswith("extend") for name in engine.compile_counts)  # chunks
    want = trainer_log_probs(model, prompts, out, 2, 1.0)
    mask = out.response_mask > 0
    assert mask.sum() > 50
    np.testing.assert_array_equal(out.rollout_log_probs[mask], want[mask])


@pytest.mark.slow
@pytest.mark.parametrize("truncation", [{"top_p": 0.8}, {"top_k": 20}])
def test_truncated_sampling_log_probs_equal_the_trainers_replayed_support(truncation):
    model = make_model(dataclasses.replace(TINY, batch_invariant=True))
    prompts = make_prompts()
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3, **truncation)
    out = generate(Engine(model, CONFIG), prompts, params)
    mask = out.response_mask > 0
    assert (out.rollout_logit_threshold[mask] > -np.inf).all()  # every token truncated
    want = trainer_log_probs(model, prompts, out, 2, 1.0, replay=True)
    np.testing.assert_array_equal(out.rollout_log_probs[mask], want[mask])
    full = trainer_log_probs(model, prompts, out, 2, 1.0)  # the kept mass: below, not equal
    assert (full[mask] < want[mask]).mean() > 0.5
