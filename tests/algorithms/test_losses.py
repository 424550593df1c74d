"""Losses: numpy references, micro-batched gradient == mini-batch gradient, entropy, KL grads."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax.algorithms import (
    LOSS_AGG_MODES,
    ActorLossConfig,
    agg_loss,
    compute_actor_loss,
    compute_value_loss,
    entropy_from_logits,
    get_policy_loss_fn,
    kl_penalty,
    loss_counts,
)

B, T, D, V = 8, 12, 8, 16


def make_batch(seed=0):
    """A tiny linear policy over fixed features, and a mini-batch with uneven masks."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 8)
    lengths = jnp.array([12, 1, 0, 5, 12, 3, 7, 2])
    mask = (jnp.arange(T)[None, :] < lengths[:, None]).astype(jnp.float32)
    batch = {
        "features": jax.random.normal(keys[0], (B, T, D)),
        "labels": jax.random.randint(keys[1], (B, T), 0, V),
        "advantages": jax.random.normal(keys[2], (B, T)),
        "old_noise": 0.3 * jax.random.normal(keys[3], (B, T)),
        "ref_noise": 0.3 * jax.random.normal(keys[4], (B, T)),
        "returns": jax.random.normal(keys[5], (B, T)),
        "values": jax.random.normal(keys[6], (B, T)),
        "response_mask": mask,
    }
    params = {"w": jax.random.normal(keys[7], (D, V)), "v": jnp.linspace(-1.0, 1.0, D)}
    return params, batch


def policy_outputs(params, batch):
    logits = batch["features"] @ params["w"]
    log_probs = jax.nn.log_softmax(logits)
    log_prob = jnp.take_along_axis(log_probs, batch["labels"][..., None], -1)[..., 0]
    return logits, log_prob


def actor_loss(params, batch, counts, config):
    logits, log_prob = policy_outputs(params, batch)
    old = jax.lax.stop_gradient(log_prob) + batch["old_noise"]
    ref = jax.lax.stop_gradient(log_prob) + batch["ref_noise"]
    entropy = entropy_from_logits(logits, chunk_size=5) if config.entropy_coeff else None
    loss, _ = compute_actor_loss(
        old,
        log_prob,
        batch["advantages"],
        batch["response_mask"],
        config=config,
        counts=counts,
        entropy_BxT=entropy,
        ref_log_prob_BxT=ref,
    )
    return loss


def critic_loss(params, batch, counts, mode):
    vpreds = batch["features"] @ params["v"]
    loss, _ = compute_value_loss(
        vpreds,
        batch["returns"],
        batch["values"],
        batch["response_mask"],
        cliprange_value=0.3,
        loss_agg_mode=mode,
        counts=counts,
    )
    return loss


MICRO_BATCH_COUNTS = (2, 4, 8)  # micro-batches of 4, 2 and 1 rows
ACTOR_CONFIGS = [ActorLossConfig(loss_agg_mode=mode) for mode in LOSS_AGG_MODES] + [
    ActorLossConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_type="k3+"),
    ActorLossConfig(loss_mode="gspo", clip_ratio=0.1),
]
CASES = [(actor_loss, config) for config in ACTOR_CONFIGS] + [
    (critic_loss, mode) for mode in LOSS_AGG_MODES
]


def case_id(case):
    loss_fn, option = case
    if loss_fn is critic_loss:
        return f"critic-{option}"
    extras = "-entropy-kl" if option.use_kl_loss else ""
    return f"actor-{option.loss_mode}-{option.loss_agg_mode}{extras}"


@functools.partial(jax.jit, static_argnames=("cases",))
def full_and_micro_batched_grads(params, batch, *, cases):
    """Per case: the mini-batch gradient, and Σ over micro-batches of the gradient computed with
    the mini-batch's counts, for each split. One program for every case: compiled once."""
    counts = loss_counts(batch["response_mask"])
    results = []
    for loss_fn, option in cases:
        full = jax.grad(loss_fn)(params, batch, None, option)
        micro_batched = []
        for num_micro in MICRO_BATCH_COUNTS:
            micro = jax.tree.map(lambda x, n=num_micro: x.reshape(n, B // n, *x.shape[1:]), batch)
            grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, None, None))(
                params, micro, counts, option
            )
            micro_batched.append(jax.tree.map(lambda g: g.sum(0), grads))
        results.append((full, micro_batched))
    return results


@pytest.fixture(scope="module")
def all_grads():
    params, batch = make_batch()
    return dict(
        zip(CASES, full_and_micro_batched_grads(params, batch, cases=tuple(CASES)), strict=True)
    )


def assert_trees_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_micro_batched_gradient_equals_mini_batch_gradient(all_grads, case):
    expected, micro_batched = all_grads[case]
    param = "w" if case[0] is actor_loss else "v"
    assert float(jnp.abs(expected[param]).max()) > 1e-3
    for got in micro_batched:
        assert_trees_close(got, expected)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_is_a_sum_of_row_shares_so_any_partition_works(mode):
    """With mini-batch counts each row's share is independent of the others: any partition of
    the rows (contiguous or interleaved micro-batches, devices) sums to the mini-batch loss."""
    _, batch = make_batch(9)
    losses, mask = batch["returns"], batch["response_mask"]
    counts = loss_counts(mask)
    rows = jax.vmap(lambda row, m: agg_loss(row[None], m[None], mode, counts))(losses, mask)
    full = agg_loss(losses, mask, mode)
    np.testing.assert_allclose(jnp.sum(rows), full, rtol=1e-6)
    interleaved = sum(agg_loss(losses[k::4], mask[k::4], mode, counts) for k in range(4))
    np.testing.assert_allclose(interleaved, full, rtol=1e-6)


def test_per_micro_batch_means_would_differ():
    """The test above can fail: averaging micro-batch token means is not the mini-batch mean."""
    _, batch = make_batch()
    losses, mask = batch["advantages"], batch["response_mask"]
    full = agg_loss(losses, mask, "token-mean")
    naive = np.mean(
        [agg_loss(losses[i : i + 2], mask[i : i + 2], "token-mean") for i in (0, 2, 4, 6)]
    )
    assert abs(float(full) - float(naive)) > 1e-3


# --- numpy references -----------------------------------------------------------------------------


def np_agg(loss, mask, mode):
    seq_sum = (loss * mask).sum(-1)
    seq_len = mask.sum(-1)
    num_seqs = (seq_len > 0).sum()
    if mode == "token-mean":
        return seq_sum.sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in zip(seq_sum, seq_len, strict=True) if n > 0) / num_seqs
    return seq_sum.sum() / mask.shape[-1]


def np_vanilla(old, new, adv, mask, low, high, c):
    loss = np.zeros_like(adv)
    clipped = np.zeros_like(adv)
    lower = np.zeros_like(adv)
    for idx in np.ndindex(adv.shape):
        ratio = np.exp(np.clip(new[idx] - old[idx], -20, 20))
        a = adv[idx]
        unclipped, clip = -a * ratio, -a * min(max(ratio, 1 - low), 1 + high)
        loss[idx] = max(unclipped, clip)
        clipped[idx] = clip > unclipped
        if a < 0 and loss[idx] > -a * c:
            loss[idx], lower[idx] = -a * c, 1.0
    return loss, clipped, lower


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_vanilla_matches_numpy(mode):
    params, batch = make_batch(2)
    _, new = policy_outputs(params, batch)
    old = new + 3 * batch["old_noise"]  # large enough to exercise both clips
    adv, mask = batch["advantages"], batch["response_mask"]
    config = ActorLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode)
    loss, metrics = get_policy_loss_fn("vanilla")(old, new, adv, mask, config=config)
    ref_loss, ref_clipped, ref_lower = np_vanilla(
        *map(np.asarray, (old, new, adv)), np.asarray(mask), 0.2, 0.28, 3.0
    )
    m = np.asarray(mask)
    assert ref_lower[m > 0].sum() > 0 and ref_clipped[m > 0].sum() > 0
    np.testing.assert_allclose(loss, np_agg(ref_loss, m, mode), rtol=1e-5)
    np.testing.assert_allclose(metrics["actor/pg_clipfrac"], (ref_clipped * m).sum() / m.sum())
    np.testing.assert_allclose(metrics["actor/pg_clipfrac_lower"], (ref_lower * m).sum() / m.sum())
    ppo_kl = ((np.asarray(old) - np.asarray(new)) * m).sum() / m.sum()
    np.testing.assert_allclose(metrics["actor/ppo_kl"], ppo_kl, rtol=1e-5)


def test_bfloat16_log_probs_give_a_float32_loss():
    params, batch = make_batch(3)
    _, new = policy_outputs(params, batch)
    old, adv, mask = new + batch["old_noise"], batch["advantages"], batch["response_mask"]
    config = ActorLossConfig(use_kl_loss=True)
    args = (old, new, adv, mask)
    loss, _ = compute_actor_loss(*args, config=config, ref_log_prob_BxT=old)
    low = [x.astype(jnp.bfloat16) for x in (old, new, adv)]
    loss_bf16, _ = compute_actor_loss(*low, mask, config=config, ref_log_prob_BxT=low[0])
    assert loss_bf16.dtype == jnp.float32
    assert float(loss_bf16) == pytest.approx(float(loss), rel=2e-2)


def test_importance_weights_scale_the_per_token_loss():
    params, batch = make_batch(3)
    _, new = policy_outputs(params, batch)
    old, adv, mask = new + batch["old_noise"], batch["advantages"], batch["response_mask"]
    config = ActorLossConfig()
    plain, _ = get_policy_loss_fn("vanilla")(old, new, adv, mask, config=config)
    weighted, _ = get_policy_loss_fn("vanilla")(
        old, new, adv, mask, config=config, rollout_is_weights_BxT=jnp.full((B, T), 2.0)
    )
    np.testing.assert_allclose(weighted, 2 * plain, rtol=1e-6)


def test_gspo_gradient_is_the_sequence_ratio_gradient():
    """Unclipped, GSPO's token-level loss has the gradient of −mean_i A_i·s_i (paper eq. 6)."""
    _, batch = make_batch(4)
    mask = batch["response_mask"]
    old = -1.0 + 0.01 * batch["old_noise"]
    adv_b = batch["advantages"][:, 0]
    adv = jnp.broadcast_to(adv_b[:, None], (B, T))
    config = ActorLossConfig(loss_mode="gspo", clip_ratio=10.0)

    def gspo(log_prob):
        return get_policy_loss_fn("gspo")(old, log_prob, adv, mask, config=config)[0]

    def sequence_objective(log_prob):
        n = mask.sum(-1)
        s = jnp.exp(jnp.where(n > 0, ((log_prob - old) * mask).sum(-1) / jnp.maximum(n, 1), 0))
        return -jnp.sum(jnp.where(n > 0, adv_b * s, 0.0)) / jnp.sum(n > 0)

    log_prob = -1.0 + 0.02 * batch["ref_noise"]
    value, grad = jax.jit(jax.value_and_grad(gspo))(log_prob)
    ref_value, ref_grad = jax.jit(jax.value_and_grad(sequence_objective))(log_prob)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-7)
    assert float(jnp.abs(grad).max()) > 1e-3


def test_value_loss_matches_numpy():
    params, batch = make_batch(5)
    vpreds = batch["features"] @ params["v"]
    loss, metrics = compute_value_loss(
        vpreds, batch["returns"], batch["values"], batch["response_mask"], cliprange_value=0.3
    )
    v, r, old, m = map(
        np.asarray, (vpreds, batch["returns"], batch["values"], batch["response_mask"])
    )
    l1, l2 = (v - r) ** 2, (np.clip(v, old - 0.3, old + 0.3) - r) ** 2
    np.testing.assert_allclose(loss, 0.5 * np_agg(np.maximum(l1, l2), m, "token-mean"), rtol=1e-5)
    np.testing.assert_allclose(metrics["critic/vf_clipfrac"], ((l2 > l1) * m).sum() / m.sum())


def test_actor_loss_combines_terms_and_requires_inputs():
    params, batch = make_batch(6)
    logits, new = policy_outputs(params, batch)
    old, ref = new + batch["old_noise"], new + batch["ref_noise"]
    adv, mask = batch["advantages"], batch["response_mask"]
    entropy = entropy_from_logits(logits)
    config = ActorLossConfig(
        entropy_coeff=0.1, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="mse"
    )
    loss, metrics = compute_actor_loss(
        old, new, adv, mask, config=config, entropy_BxT=entropy, ref_log_prob_BxT=ref
    )
    expected_kl = float(((0.5 * (new - ref) ** 2) * mask).sum() / mask.sum())
    expected_entropy = float((entropy * mask).sum() / mask.sum())
    assert float(metrics["actor/kl_loss"]) == pytest.approx(expected_kl, rel=1e-5)
    assert float(metrics["actor/entropy"]) == pytest.approx(expected_entropy, rel=1e-5)
    expected = float(metrics["actor/pg_loss"]) - 0.1 * expected_entropy + 0.5 * expected_kl
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="entropy_BxT"):
        compute_actor_loss(old, new, adv, mask, config=config, ref_log_prob_BxT=ref)
    with pytest.raises(ValueError, match="ref_log_prob_BxT"):
        compute_actor_loss(old, new, adv, mask, config=config, entropy_BxT=entropy)


# --- entropy and KL gradients ---------------------------------------------------------------------


def direct_entropy(logits):
    probs = jax.nn.softmax(logits)
    return -jnp.sum(probs * jax.nn.log_softmax(logits), -1)


@functools.partial(jax.jit, static_argnames=("entropy_fn",))
def entropy_and_grad(logits, weights, entropy_fn):
    """Entropy B×T and the gradient of a weighted sum of it."""
    grad = jax.grad(lambda z: jnp.sum(weights * entropy_fn(z)))(logits)
    return entropy_fn(logits), grad


@pytest.mark.parametrize("chunk_size", [4, 5, 12])
def test_chunked_entropy_equals_direct_entropy_and_gradient(chunk_size):
    logits = 3 * jax.random.normal(jax.random.PRNGKey(7), (2, T, V))
    weights = jax.random.normal(jax.random.PRNGKey(8), (2, T))
    chunked = functools.partial(entropy_from_logits, chunk_size=chunk_size)
    entropy, grad = entropy_and_grad(logits, weights, chunked)
    ref_entropy, ref_grad = entropy_and_grad(logits, weights, direct_entropy)
    np.testing.assert_allclose(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-5)


def test_entropy_of_uniform_logits_is_log_vocab():
    np.testing.assert_allclose(entropy_from_logits(jnp.zeros((1, 3, V)), 2), np.log(V), rtol=1e-6)


@pytest.mark.parametrize("name", ["k1+", "kl+", "k3+", "low_var_kl+", "abs+"])
def test_straight_through_kl_has_k2_gradient(name):
    logp = jnp.array([-1.0, -0.5, -3.0])
    ref = jnp.array([-2.0, -0.4, -1.0])
    value = kl_penalty(logp, ref, name)
    np.testing.assert_allclose(value, kl_penalty(logp, ref, name[:-1]), rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(kl_penalty(x, ref, name)))(logp)
    np.testing.assert_allclose(grad, logp - ref, rtol=1e-6)


def test_k3_gradient_without_straight_through():
    logp, ref = jnp.array([-1.0, -0.5]), jnp.array([-2.0, -0.4])
    grad = jax.grad(lambda x: jnp.sum(kl_penalty(x, ref, "k3")))(logp)
    np.testing.assert_allclose(grad, 1 - np.exp(np.asarray(ref - logp)), rtol=1e-5)


def test_unknown_kl_type_lists_valid_ones():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(jnp.zeros(1), jnp.zeros(1), "k4")
