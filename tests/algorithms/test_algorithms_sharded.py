"""Sharded over 8 devices along the batch == one device: group stats, whitening, loss counts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybridjax.algorithms import (
    ActorLossConfig,
    AlgorithmConfig,
    compute_actor_loss,
    compute_advantage,
    loss_counts,
)

B, T, N = 16, 8, 4
ACTOR = ActorLossConfig(loss_agg_mode="seq-mean-token-mean")


@functools.partial(jax.jit, static_argnames=("estimator",))
def advantages_and_actor_grad(rewards, values, old, log_prob, mask, estimator):
    config = AlgorithmConfig(adv_estimator=estimator)
    advantages, returns = compute_advantage(
        rewards, mask, config=config, uid_B=jnp.arange(B) // N, values_BxT=values
    )

    def loss(lp):
        return compute_actor_loss(
            old, lp, advantages, mask, config=ACTOR, counts=loss_counts(mask)
        )[0]

    return advantages, returns, jax.grad(loss)(log_prob)


def test_batch_sharded_equals_single_device():
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    lengths = jax.random.randint(keys[0], (B,), 0, T + 1)
    mask = (jnp.arange(T)[None, :] < lengths[:, None]).astype(jnp.float32)
    inputs = (
        jax.random.normal(keys[1], (B, T)),
        jax.random.normal(keys[2], (B, T)),
        -jax.random.uniform(keys[3], (B, T)),
        -jax.random.uniform(keys[4], (B, T)),
        mask,
    )
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    sharded = jax.device_put(inputs, NamedSharding(mesh, PartitionSpec("data")))
    single = jax.device_put(inputs, jax.devices()[0])
    for estimator in ("grpo", "gae"):
        got = advantages_and_actor_grad(*sharded, estimator=estimator)
        expected = advantages_and_actor_grad(*single, estimator=estimator)
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
