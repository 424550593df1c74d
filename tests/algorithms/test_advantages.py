"""Advantage estimators against plain numpy loops, property tests, registry strictness."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridjax.algorithms import (
    ADV_ESTIMATORS,
    AlgorithmConfig,
    compute_advantage,
    masked_whiten,
    register_adv_est,
)

B, T, N = 8, 12, 4  # one shape for every test: compiled once
ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")


@functools.partial(jax.jit, static_argnames=("config",))
def advantage_jit(rewards, mask, values, baselines, uid, *, config):
    return compute_advantage(
        rewards,
        mask,
        config=config,
        uid_B=uid,
        values_BxT=values,
        reward_baselines_B=baselines,
    )


whiten_jit = jax.jit(masked_whiten)


def random_batch(seed, holes=True):
    """Rewards, values, mask (B×T) with an all-masked row, right padding and interior holes."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, T + 1, size=B)
    lengths[seed % B] = 0  # always at least one row with no valid token
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    if holes:
        mask *= rng.random((B, T)) > 0.2
    rewards = rng.normal(size=(B, T)).astype(np.float32)
    values = rng.normal(size=(B, T)).astype(np.float32)
    baselines = rng.normal(size=B).astype(np.float32)
    return rewards, values, mask, baselines


# --- numpy references: one row, one token at a time -------------------------------------------


def np_whiten(x, mask):
    valid = x[mask > 0].astype(np.float64)
    out = np.zeros_like(x, dtype=np.float64)
    if valid.size == 0:
        return out
    var = valid.var(ddof=1) if valid.size > 1 else 0.0
    out = (x - valid.mean()) / np.sqrt(var + 1e-8)
    return np.where(mask > 0, out, 0.0)


def np_gae(rewards, values, mask, gamma, lam):
    advantages = np.zeros((B, T))
    for b in range(B):
        next_value = last_gae = 0.0
        for t in reversed(range(T)):
            if mask[b, t]:
                delta = rewards[b, t] + gamma * next_value - values[b, t]
                last_gae = delta + gamma * lam * last_gae
                next_value = values[b, t]
                advantages[b, t] = last_gae
    return np_whiten(advantages, mask), (advantages + values) * mask


def np_returns_to_go(rewards, mask, gamma):
    returns = np.zeros((B, T))
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            if mask[b, t]:
                running = rewards[b, t] + gamma * running
                returns[b, t] = running
    return returns


def np_group_advantage(scores, n, kind):
    out = np.zeros(B)
    for start in range(0, B, n):
        group = scores[start : start + n].astype(np.float64)
        for i in range(n):
            if n == 1:
                out[start + i] = {"grpo": group[0] / (1 + 1e-6), "rloo": group[0]}[kind]
            elif kind == "grpo":
                out[start + i] = (group[i] - group.mean()) / (group.std(ddof=1) + 1e-6)
            elif kind == "rloo":
                out[start + i] = group[i] - np.mean(np.delete(group, i))  # leave one out
    return out


def run(name, rewards, values, mask, baselines, group_size=N, uid=None, **config):
    """The estimator, jitted; groups are contiguous blocks of `group_size` unless `uid`."""
    config = AlgorithmConfig(adv_estimator=name, **config)
    uid = np.arange(B) // group_size if uid is None else uid
    args = (rewards, mask, values, baselines, np.asarray(uid, np.int32))
    advantages, returns = advantage_jit(*map(jnp.asarray, args), config=config)
    return np.asarray(advantages), np.asarray(returns)


# --- against the loops --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_whiten_matches_numpy(seed):
    rewards, _, mask, _ = random_batch(seed)
    np.testing.assert_allclose(whiten_jit(rewards, mask), np_whiten(rewards, mask), atol=1e-5)


def test_whiten_of_empty_and_single_token_masks_is_zero():
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(whiten_jit(x, jnp.zeros((2, 3))), np.zeros((2, 3)))
    single = jnp.zeros((2, 3)).at[1, 1].set(1.0)
    np.testing.assert_array_equal(whiten_jit(x, single), np.zeros((2, 3)))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.8)])
def test_gae_matches_numpy(seed, gamma, lam):
    rewards, values, mask, baselines = random_batch(seed)
    advantages, returns = run("gae", rewards, values, mask, baselines, gamma=gamma, lam=lam)
    ref_advantages, ref_returns = np_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(returns, ref_returns, atol=1e-5)
    np.testing.assert_allclose(advantages, ref_advantages, atol=1e-4)
    assert np.all(advantages[mask.sum(-1) == 0] == 0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("group_size", [1, 4])
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_group_estimators_match_numpy(seed, group_size, kind):
    rewards, values, mask, baselines = random_batch(seed)
    advantages, returns = run(kind, rewards, values, mask, baselines, group_size=group_size)
    scores = (rewards * mask).sum(-1)
    expected = np_group_advantage(scores, group_size, kind)[:, None] * mask
    np.testing.assert_allclose(advantages, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(advantages, returns)


@pytest.mark.parametrize("seed", range(3))
def test_reinforce_plus_plus_matches_numpy(seed):
    rewards, values, mask, baselines = random_batch(seed)
    advantages, returns = run("reinforce_plus_plus", rewards, values, mask, baselines, gamma=0.9)
    ref_returns = np_returns_to_go(rewards, mask, 0.9)
    np.testing.assert_allclose(returns, ref_returns, atol=1e-5)
    np.testing.assert_allclose(advantages, np_whiten(ref_returns, mask), atol=1e-4)


@pytest.mark.parametrize("seed", range(3))
def test_reinforce_plus_plus_baseline_matches_numpy(seed):
    rewards, values, mask, baselines = random_batch(seed)
    advantages, _ = run("reinforce_plus_plus_baseline", rewards, values, mask, baselines)
    scores = (rewards * mask).sum(-1)
    centred = scores - np.repeat(scores.reshape(-1, N).mean(1), N)
    np.testing.assert_allclose(advantages, np_whiten(centred[:, None] * mask, mask), atol=1e-4)


@pytest.mark.parametrize("seed", range(3))
def test_remax_matches_numpy(seed):
    rewards, values, mask, baselines = random_batch(seed)
    advantages, returns = run("remax", rewards, values, mask, baselines)
    ref_returns = np_returns_to_go(rewards, mask, 1.0)
    np.testing.assert_allclose(returns, ref_returns, atol=1e-5)
    np.testing.assert_allclose(advantages, (ref_returns - baselines[:, None]) * mask, atol=1e-5)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_jitted_equals_not_jitted_and_masked_is_zero(name):
    rewards, values, mask, baselines = random_batch(7)
    config = AlgorithmConfig(adv_estimator=name, gamma=0.95, lam=0.9)
    eager = compute_advantage(
        jnp.asarray(rewards),
        jnp.asarray(mask),
        config=config,
        uid_B=jnp.arange(B) // N,
        values_BxT=jnp.asarray(values),
        reward_baselines_B=jnp.asarray(baselines),
    )
    jitted = run(name, rewards, values, mask, baselines, gamma=0.95, lam=0.9)
    for a, b in zip(eager, jitted, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert np.all(np.isfinite(b)) and np.all(b[mask == 0] == 0)


# --- properties ---------------------------------------------------------------------------------

GROUPED = ("grpo", "rloo", "reinforce_plus_plus_baseline")
scores_strategy = st.lists(st.integers(0, 3).map(float), min_size=B, max_size=B)


def outcome_batch(scores, lengths):
    mask = (np.arange(T)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)
    last = np.clip(np.asarray(lengths) - 1, 0, T - 1)
    rewards = np.zeros((B, T), np.float32)
    rewards[np.arange(B), last] = np.asarray(scores) * (np.asarray(lengths) > 0)
    return rewards, mask


@settings(max_examples=10, deadline=None)
@given(
    scores=scores_strategy,
    lengths=st.lists(st.integers(1, T), min_size=B, max_size=B),
    group_order=st.permutations(range(B // N)),
    name=st.sampled_from(GROUPED),
)
def test_permuting_whole_groups_permutes_advantages(scores, lengths, group_order, name):
    rewards, mask = outcome_batch(scores, lengths)
    rows = np.concatenate([np.arange(g * N, (g + 1) * N) for g in group_order])
    zeros_b, zeros_bt = np.zeros(B, np.float32), np.zeros((B, T), np.float32)
    advantages, _ = run(name, rewards, zeros_bt, mask, zeros_b)
    permuted, _ = run(name, rewards[rows], zeros_bt, mask[rows], zeros_b)
    np.testing.assert_allclose(permuted, advantages[rows], rtol=1e-5, atol=1e-6)


@settings(max_examples=10, deadline=None)
@given(
    scores=scores_strategy,
    lengths=st.lists(st.integers(1, T), min_size=B, max_size=B),
    order=st.permutations(range(N)),
    name=st.sampled_from(GROUPED),
)
def test_permuting_within_a_group_permutes_advantages(scores, lengths, order, name):
    rewards, mask = outcome_batch(scores, lengths)
    rows = np.concatenate([np.asarray(order), np.arange(N, B)])
    zeros_b, zeros_bt = np.zeros(B, np.float32), np.zeros((B, T), np.float32)
    advantages, _ = run(name, rewards, zeros_bt, mask, zeros_b)
    permuted, _ = run(name, rewards[rows], zeros_bt, mask[rows], zeros_b)
    np.testing.assert_allclose(permuted, advantages[rows], rtol=1e-5, atol=1e-6)


@settings(max_examples=10, deadline=None)
@given(
    scores=scores_strategy,
    shift=st.floats(-5, 5),
    norm=st.booleans(),
    name=st.sampled_from(("grpo", "rloo")),
)
def test_group_advantages_sum_to_zero_and_ignore_a_shift(scores, shift, norm, name):
    rewards, mask = outcome_batch(scores, [T] * B)
    zeros_b, zeros_bt = np.zeros(B, np.float32), np.zeros((B, T), np.float32)
    advantages, _ = run(name, rewards, zeros_bt, mask, zeros_b, norm_adv_by_std_in_grpo=norm)
    shifted_rewards, _ = outcome_batch(np.asarray(scores) + shift, [T] * B)
    shifted, _ = run(name, shifted_rewards, zeros_bt, mask, zeros_b, norm_adv_by_std_in_grpo=norm)
    np.testing.assert_allclose(advantages[:, 0].reshape(-1, N).sum(1), 0.0, atol=1e-4)
    np.testing.assert_allclose(shifted, advantages, atol=1e-4)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_whitened_advantages_have_zero_mean_unit_variance(seed):
    rewards, values, mask, baselines = random_batch(seed)
    advantages, _ = run("gae", rewards, values, mask, baselines)
    valid = advantages[mask > 0]
    assert abs(valid.mean()) < 1e-4
    assert valid.var(ddof=1) == pytest.approx(1.0, rel=1e-3)


# --- registry -------------------------------------------------------------------------------


@pytest.fixture
def custom_estimator():
    @register_adv_est("test_zero")
    def zero(token_level_rewards_BxT, response_mask_BxT, **_):
        return jnp.zeros_like(token_level_rewards_BxT), jnp.zeros_like(token_level_rewards_BxT)

    yield zero
    del ADV_ESTIMATORS._fns["test_zero"]


def test_registry_adds_estimator_without_touching_the_trainer(custom_estimator):
    config = AlgorithmConfig(adv_estimator="test_zero")
    advantages, _ = compute_advantage(jnp.ones((2, 3)), jnp.ones((2, 3)), config=config)
    np.testing.assert_array_equal(advantages, np.zeros((2, 3)))
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("test_zero")(custom_estimator)


def test_registry_is_strict():
    assert set(ESTIMATORS) <= set(ADV_ESTIMATORS.names())
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("gae")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="grpo.*reinforce_plus_plus_baseline"):
        AlgorithmConfig(adv_estimator="gpro")


def test_missing_inputs_raise():
    rewards, mask = jnp.ones((4, 3)), jnp.ones((4, 3))
    with pytest.raises(ValueError, match="values_BxT"):
        compute_advantage(rewards, mask, config=AlgorithmConfig(adv_estimator="gae"))
    with pytest.raises(ValueError, match="reward_baselines_B"):
        compute_advantage(rewards, mask, config=AlgorithmConfig(adv_estimator="remax"))
    with pytest.raises(ValueError, match="uid_B"):
        compute_advantage(rewards, mask, config=AlgorithmConfig(adv_estimator="grpo"))
