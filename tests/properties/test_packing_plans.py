"""Properties of the packing plans.

`hybridjax.models.packing.plan` / `buffer`: every valid token of every row is placed exactly
once (no two tokens share a slot, no slot holds anything else), each row reads a prompt copy
equal to its own prompt, positions continue from the prompt, the slot predicting each response
token is the previous token of the same sequence, `gather_response` brings the responses back
in the padded B×R layout, and `over_buffers` visits every row exactly once. Random batches:
prompt and response lengths, groups of unequal size, prompts equal or not within a group,
1 or 2 data-parallel pieces, 1 or 2 buffer rows per step, sharing on or off.

`hybridjax.training.packing` sizes the plans (`PackingConfig.for_budget`, `row_responses`): a row
always holds one whole sequence, never exceeds the budget when a sequence fits it, and k is the
cheapest by the cost model of `row_responses`'s docstring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridjax.config.schema import base_config
from hybridjax.models import packing
from hybridjax.models.packing import STEPS_PER_BUDGET, PackingConfig, row_responses
from hybridjax.training.packing import PASSES, packing_configs

FAST = settings(max_examples=20, deadline=None)
B, P, R = 8, 4, 4  # one batch shape; the plan's configs vary


@st.composite
def batches(draw):
    """(input_ids B×(P+R), attention mask, group ids): prompts left padded, responses right
    padded; response token ids are unique, prompt ids come from a small vocabulary."""
    sizes, left = [], B
    while left:
        sizes.append(draw(st.integers(1, left)))
        left -= sizes[-1]
    group_B = np.repeat(np.arange(len(sizes)), sizes)
    ids = np.zeros((B, P + R), np.int32)
    mask = np.zeros((B, P + R), np.int32)
    for g in range(len(sizes)):
        same_prompt = draw(st.booleans())
        prompt = None
        for b in np.flatnonzero(group_B == g):
            if prompt is None or not same_prompt:
                p = draw(st.integers(1, P))
                prompt = draw(st.lists(st.integers(1, 3), min_size=p, max_size=p))
            ids[b, P - len(prompt) : P] = prompt
            mask[b, P - len(prompt) : P] = 1
            r = draw(st.integers(0, R))
            ids[b, P : P + r] = 100 + 10 * b + np.arange(r)
            mask[b, P : P + r] = 1
    return ids, mask, group_B.astype(np.int32)


configs = st.builds(
    PackingConfig,
    row_length=st.just(10),  # P + R and room for a second short sequence
    rows=st.sampled_from([1, 2]),
    pieces=st.sampled_from([1, 2]),
    share_prompts=st.booleans(),
)

# jitted once per static config (8 of them), so examples reuse compiled programs
plan = jax.jit(packing.plan, static_argnames=("response_length", "config"))
step_buffers = jax.jit(packing.buffer)
gather_response = jax.jit(packing.gather_response, static_argnames="response_length")
source_index = jax.jit(packing.source_index)
in_buffer = jax.jit(packing.in_buffer)


@jax.jit
def visits(pl):
    """Per row, how many times `over_buffers` hands it to the body."""
    count = lambda step_plan, k, seen: seen + packing.in_buffer(step_plan, k).astype(jnp.int32)
    return packing.over_buffers(pl, count, jnp.zeros(B, jnp.int32))


def _check_placement(ids, mask, pl, config, steps):
    """Every token in exactly one slot, each row's prompt copy its own, positions right."""
    m = B // config.pieces
    buffer_B, prompt_start_B, response_start_B, writes_B = (
        np.asarray(x).reshape(-1)
        for x in (pl.buffer, pl.prompt_start, pl.response_start, pl.writes_prompt)
    )
    placed = set()
    for b in range(B):
        piece, buf = b // m, int(buffer_B[b])
        out, row = steps[buf // config.rows], piece * config.rows + buf % config.rows
        p, r = int(mask[b, :P].sum()), int(mask[b, P:].sum())
        ps, rs = int(prompt_start_B[b]), int(response_start_B[b])
        np.testing.assert_array_equal(out["input_ids"][row, ps : ps + p], ids[b, P - p : P])
        np.testing.assert_array_equal(out["positions"][row, ps : ps + p], np.arange(p))
        np.testing.assert_array_equal(out["input_ids"][row, rs : rs + r], ids[b, P : P + r])
        np.testing.assert_array_equal(out["positions"][row, rs : rs + r], p + np.arange(r))
        new = {(piece, buf, rs + t) for t in range(r)}
        if writes_B[b]:
            new |= {(piece, buf, ps + j) for j in range(p)}
        else:
            assert config.share_prompts, "without sharing every row writes its own prompt"
        assert all(s[2] < config.row_length for s in new)
        assert placed.isdisjoint(new), f"row {b} writes over another token"
        placed |= new
    valid = sum(int(out["valid"].sum()) for out in steps)
    assert valid == len(placed), "a slot is valid that no token was written to"


@FAST
@given(batch=batches(), config=configs)
def test_every_token_is_placed_once_and_comes_back(batch, config):
    ids, mask, group_B = batch
    ids_j = jnp.asarray(ids)
    pl = plan(
        ids_j, jnp.asarray(mask), response_length=R, group_ids_B=jnp.asarray(group_B), config=config
    )
    num_steps = -(-int(pl.num_buffers) // pl.rows)
    steps = [jax.tree.map(np.asarray, step_buffers(pl, ids_j, k)) for k in range(num_steps)]
    _check_placement(ids, mask, pl, config, steps)

    response_mask = mask[:, P:] > 0
    previous = np.concatenate([ids[:, P - 1 : P], ids[:, P : P + R - 1]], axis=1)
    back = np.zeros((B, R), np.int32)
    for k, out in enumerate(steps):
        back += np.asarray(gather_response(pl, out["input_ids"], k, response_length=R))
        # the slot predicting each response token holds the previous token of its sequence
        source = np.asarray(source_index(pl, k))
        predictor = np.take_along_axis(out["input_ids"], source, axis=1)
        got = np.asarray(gather_response(pl, predictor, k, response_length=R))
        here = np.asarray(in_buffer(pl, k))[:, None] & response_mask
        np.testing.assert_array_equal(got[here], previous[here])
    np.testing.assert_array_equal(back, ids[:, P:] * mask[:, P:])  # the padded B×R layout
    np.testing.assert_array_equal(np.asarray(visits(pl)), np.ones(B))  # each row once


def _cost(p, r, n, pair_cost, k):
    """`row_responses`'s cost model: ⌈n/k⌉ rows of L = P + k·R tokens, each L + c·L²."""
    length = p + k * r
    return -(-n // k) * (length + pair_cost * length**2)


@settings(max_examples=200, deadline=None)
@given(
    p=st.integers(1, 300),
    r=st.integers(1, 300),
    n=st.integers(1, 16),
    pair_cost=st.sampled_from([0.0, 1e-4, 1e-3, 0.05]),
    budget=st.integers(1, 8192),
    share=st.booleans(),
)
def test_rows_hold_a_sequence_and_respect_the_budget(p, r, n, pair_cost, budget, share):
    config = PackingConfig.for_budget(budget, p, r, n, pair_cost, share_prompts=share)
    assert config.row_length >= p + r  # a row always holds one whole sequence
    if p + r <= budget:
        assert config.row_length <= budget
    if not share:
        assert config.row_length == p + r
    assert config.rows >= 1
    if config.rows > 1:
        assert config.rows * config.row_length * STEPS_PER_BUDGET <= budget
    k = row_responses(p, r, n, pair_cost, budget)
    fits = [j for j in range(1, n + 1) if p + j * r <= budget] or [1]
    assert k in fits
    assert _cost(p, r, n, pair_cost, k) == min(_cost(p, r, n, pair_cost, j) for j in fits)


@settings(max_examples=20, deadline=None)
@given(dp=st.sampled_from([1, 2, 4]), off=st.sets(st.sampled_from(PASSES)))
def test_trainer_configs_follow_the_keys(dp, off):
    cfg = base_config()
    models = {
        "old_log_prob": cfg.actor_rollout_ref.model,
        "update_actor": cfg.actor_rollout_ref.model,
        "ref": cfg.actor_rollout_ref.model,
        "values": cfg.critic.model,
        "update_critic": cfg.critic.model,
        "reward_model": cfg.reward_model.model,
    }
    for name in off:
        models[name].use_remove_padding = False
    out = packing_configs(cfg, dp)
    for name in PASSES:
        if models[name].use_remove_padding:
            assert out[name] is not None and out[name].pieces == dp
        else:
            assert out[name] is None
