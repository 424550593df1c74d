"""Group estimators over uid groups of any size and order, against a numpy transcription of
verl's `core_algos.py` (dicts keyed by `index`, one loop per row)."""

from __future__ import annotations

import collections
import functools

import jax
import numpy as np
import pytest

from hybridjax.algorithms import AlgorithmConfig, compute_advantage

B, T = 12, 6
EPS = 1e-6


@functools.partial(jax.jit, static_argnames=("config",))
def estimate(rewards, mask, uid, *, config):
    return compute_advantage(rewards, mask, config=config, uid_B=uid)


def verl_group_advantage(scores, index, kind, norm_adv_by_std=True):
    """verl's compute_{grpo,rloo,reinforce_plus_plus_baseline}_outcome_advantage, per row (B,),
    before the broadcast over tokens (and, for REINFORCE++-baseline, before whitening)."""
    id2score = collections.defaultdict(list)
    for score, idx in zip(scores, index, strict=True):
        id2score[idx].append(score)
    id2mean, id2std = {}, {}
    for idx, group in id2score.items():
        group = np.asarray(group, np.float64)
        single = len(group) == 1
        id2mean[idx] = 0.0 if single else group.mean()
        id2std[idx] = 1.0 if single else group.std(ddof=1)
    out = np.zeros(len(scores))
    for i, (score, idx) in enumerate(zip(scores, index, strict=True)):
        n = len(id2score[idx])
        if kind == "grpo":
            centred = score - id2mean[idx]
            out[i] = centred / (id2std[idx] + EPS) if norm_adv_by_std else centred
        elif kind == "rloo":
            out[i] = score * n / (n - 1) - id2mean[idx] * n / (n - 1) if n > 1 else score
        else:
            out[i] = score - id2mean[idx]
    return out


def verl_masked_whiten(values, mask):
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum()
    var = var * mask.sum() / (mask.sum() - 1)
    return (values - mean) / np.sqrt(var + 1e-8)


def shuffled_unequal_groups(seed):
    """Rewards, mask (B×T, holes and an empty row) and uids of groups of sizes 1..5, shuffled."""
    rng = np.random.default_rng(seed)
    sizes = [1, 2, 5, 4]  # 12 rows
    uid = np.repeat(rng.permutation(B)[: len(sizes)], sizes)  # sparse uids in [0, B)
    rng.shuffle(uid)
    mask = (rng.random((B, T)) < 0.8).astype(np.float32)
    mask[seed % B] = 0.0
    rewards = rng.normal(size=(B, T)).astype(np.float32)
    return rewards, mask, uid.astype(np.int32)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "kind, norm",
    [("grpo", True), ("grpo", False), ("rloo", True), ("reinforce_plus_plus_baseline", True)],
)
def test_uid_groups_match_verl(seed, kind, norm):
    rewards, mask, uid = shuffled_unequal_groups(seed)
    config = AlgorithmConfig(adv_estimator=kind, norm_adv_by_std_in_grpo=norm)
    advantages, returns = estimate(rewards, mask, uid, config=config)
    scores = (rewards.astype(np.float64) * mask).sum(-1)
    expected = verl_group_advantage(scores, uid.tolist(), kind, norm)[:, None] * mask
    if kind == "reinforce_plus_plus_baseline":
        expected = verl_masked_whiten(expected, mask) * mask
    np.testing.assert_allclose(advantages, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(advantages, returns)


def test_worked_value_and_row_order():
    """Rewards [1, 0, 0, 0] with uids [a, b, a, b] give GRPO advantages [0.707, 0, −0.707, 0];
    any permutation of the rows permutes the advantages."""
    rewards = np.zeros((4, 2), np.float32)
    rewards[:, -1] = [1, 0, 0, 0]
    mask, uid = np.ones((4, 2), np.float32), np.array([0, 1, 0, 1], np.int32)
    config = AlgorithmConfig(adv_estimator="grpo")
    advantages, _ = estimate(rewards, mask, uid, config=config)
    np.testing.assert_allclose(advantages[:, 0], [0.70710, 0, -0.70710, 0], atol=1e-5)
    order = np.array([3, 0, 2, 1])
    permuted, _ = estimate(rewards[order], mask[order], uid[order], config=config)
    np.testing.assert_array_equal(permuted, np.asarray(advantages)[order])
