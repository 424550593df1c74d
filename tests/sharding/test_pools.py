"""Resource pools and placement on 8 simulated CPU devices: the default pool is the old meshes,
split pools slice the devices in order, config problems name the pool and the role, and the
actor's weights cross pools bit-exactly in both directions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridjax.config.checks import ConfigError
from hybridjax.config.schema import base_config
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.rl.checks import validate
from hybridjax.sharding import (
    ACTOR_GENERATE_RULES,
    ACTOR_TRAIN_RULES,
    MeshConfig,
    init_sharded,
    make_meshes,
    state_shardings,
)
from hybridjax.sharding.pools import make_placement, placement_problems, sync_weights
from tests.rl.tiny_run import load_config_file

MODEL = ModelConfig(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
)  # fmt: skip


def _split(rollout=4, train=4, **changes):
    c = base_config()
    c.resource_pool = dict(
        rollout_pool=dict(n_devices=rollout, generate=dict(data=-1, tensor=2)),
        train_pool=dict(n_devices=train),
    )
    c.placement.update(dict(actor="train_pool", ref="train_pool", critic="train_pool"))
    c.placement.update(dict(reward_model="train_pool", rollout="rollout_pool"))
    c.update_from_flattened_dict(changes)
    return c


def test_default_pool_is_the_old_meshes():
    meshes = make_placement(base_config()).meshes()
    old = make_meshes(MeshConfig.from_config(base_config()))
    assert meshes.train.devices.tolist() == old.train.devices.tolist()
    assert meshes.generate.devices.tolist() == old.generate.devices.tolist()
    assert dict(meshes.train.shape) == dict(old.train.shape)


def test_split_pools_take_consecutive_devices():
    placement = make_placement(_split())
    devices = jax.devices()
    meshes = placement.meshes()
    assert list(meshes.generate.devices.flat) == devices[:4]
    assert list(meshes.train.devices.flat) == devices[4:]
    assert dict(meshes.generate.shape) == {"data": 2, "tensor": 2}
    assert dict(meshes.train.shape) == {"data": 1, "expert": 1, "fsdp": 4, "tensor": 1}
    assert not placement.co_located


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"resource_pool.rollout_pool.n_devices": 6}, "add up to 10, not the 8 devices"),
        (
            {"resource_pool.train_pool.n_devices": -1, "resource_pool.rollout_pool.n_devices": 8},
            "resource_pool.train_pool.n_devices=-1 gets no device",
        ),
        ({"placement.rollout": "gpu_pool"}, "placement.rollout: no pool named 'gpu_pool'"),
        (
            {"resource_pool.rollout_pool.generate.tensor": 3},
            "resource_pool.rollout_pool (4 devices, roles ['rollout']): generate mesh",
        ),
    ],
)
def test_placement_problems_name_pool_and_role(changes, expected):
    problems = placement_problems(_split(**changes), 8)
    assert any(expected in p for p in problems), problems


def test_a_pool_of_unused_roles_is_refused():
    c = _split(rollout=2)
    c.resource_pool.ref_pool = dict(n_devices=2)
    c.placement.ref = "ref_pool"
    (problem,) = placement_problems(c, 8)
    assert problem.startswith(
        "resource_pool.ref_pool (2 devices) holds only ['ref', 'teacher'], which this config "
        "does not use (no KL term"
    )  # placement.teacher "": the ref's pool
    c.actor_rollout_ref.actor.use_kl_loss = True
    assert not placement_problems(c, 8)
    c.actor_rollout_ref.actor.use_kl_loss = False
    c.actor_rollout_ref.distillation.enabled = True  # placement.teacher "": the ref's pool
    assert not placement_problems(c, 8)
    c.placement.teacher = "train_pool"  # the teacher elsewhere: ref_pool holds ref alone
    (problem,) = placement_problems(c, 8)
    assert "ref_pool (2 devices) holds only ['ref']" in problem
    c.placement.teacher = "teacher_pool"
    assert placement_problems(c, 8) == [
        "placement.teacher: no pool named 'teacher_pool' (pools: ['ref_pool', 'rollout_pool', "
        "'train_pool'])"
    ]


def test_critic_pool_batch_checks_name_the_pool_and_role():
    """16 prompts split over the 3 devices of the critic's own pool in no way."""
    c = load_config_file("tiny")
    c.resource_pool = dict(critic_pool=dict(n_devices=3), gen=dict(n_devices=1), train=dict())
    c.resource_pool.train.n_devices = 4
    c.placement.update(dict(actor="train", ref="train", reward_model="train", rollout="gen"))
    c.placement.critic = "critic_pool"
    c.data.train_files = __file__  # any existing file
    c.data.val_files = ""
    with pytest.raises(ConfigError, match=r"resource_pool\.critic_pool \(3 devices, roles "):
        validate(c, 8)
    c.resource_pool.critic_pool.n_devices = c.resource_pool.gen.n_devices = 2
    c.resource_pool.train.n_devices = 4
    validate(c, 8)


def test_async_modes_need_split_pools():
    c = base_config()
    c.trainer.rollout_mode = "one_step_off"
    (problem,) = placement_problems(c, 8)
    assert "placement.rollout" in problem and "'global_pool'" in problem
    assert not placement_problems(_split(**{"trainer.rollout_mode": "one_step_off"}), 8)


def test_trainer_check_runs_batch_checks_per_pool():
    """data.train_batch_size 6 divides the 8 devices of one pool in no way, and the actor pool
    of 4 devices neither: the message names the pool and its roles."""
    c = load_config_file("tiny")
    c.resource_pool = dict(gen=dict(n_devices=4), train=dict(n_devices=4))
    c.placement.update(dict(actor="train", ref="train", critic="train", reward_model="train"))
    c.placement.rollout = "gen"
    c.data.train_files = __file__  # any existing file
    c.data.val_files = ""
    validate(c, 8)  # 16 prompts: fine on 4 + 4
    c.data.train_batch_size = c.actor_rollout_ref.actor.ppo_mini_batch_size = 6
    c.critic.ppo_mini_batch_size = 6
    with pytest.raises(ConfigError, match=r"resource_pool\.train \(4 devices, roles \['actor'"):
        validate(c, 8)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_weight_sync_across_pools_is_bit_exact_both_ways():
    c = _split()
    c.resource_pool.train_pool.train = dict(data=1, fsdp=-1, tensor=1)
    placement = make_placement(c)
    meshes = placement.meshes()
    _, params = nnx.split(init_sharded(CausalLM, MODEL, meshes.train, ACTOR_TRAIN_RULES, 0))
    gen = state_shardings(params, meshes.generate, ACTOR_GENERATE_RULES)
    moved, nbytes = sync_weights(params, gen)
    for leaf in jax.tree.leaves(moved):
        assert leaf.sharding.device_set == set(jax.devices()[:4])
    # float32 bytes × the 4 devices of the rollout pool × elements per shard
    expected = sum(4 * 4 * np.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(moved))
    assert nbytes == expected
    back, _ = sync_weights(moved, jax.tree.map(lambda x: x.sharding, params))
    for a, b, c in zip(_leaves(params), _leaves(moved), _leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert all(
        x.sharding == y.sharding
        for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True)
    )
    cast, half = sync_weights(params, gen, jnp.bfloat16)
    assert half * 2 == nbytes
    for a, b in zip(_leaves(params), _leaves(cast), strict=True):
        np.testing.assert_array_equal(a.astype(jnp.bfloat16), b)


def test_rollout_mode_keys_are_checked():
    c = load_config_file("tiny")
    c.data.train_files, c.data.val_files = __file__, ""
    c.trainer.rollout_mode = "eager"
    c.trainer.staleness_threshold = 2  # read only by async
    c.actor_rollout_ref.actor.fsdp_config.param_offload = True
    with pytest.raises(ConfigError) as err:
        validate(c, 8)
    message = str(err.value)
    assert "trainer.rollout_mode: one of ('sync', 'one_step_off', 'async') (got 'eager')" in message
    assert (
        "trainer.staleness_threshold (2) is read only with trainer.rollout_mode='async'" in message
    )
    assert "['actor_rollout_ref.actor.fsdp_config.param_offload'] offload" in message


@pytest.mark.parametrize(
    "changes, expected",
    [
        (
            {"trainer.rollout_mode": "one_step_off"},
            "trainer.partial_rollout needs trainer.rollout_mode='async' (got 'one_step_off') "
            "and trainer.staleness_threshold >= 1",
        ),
        (
            {"trainer.rollout_mode": "async", "trainer.staleness_threshold": 0},
            "trainer.staleness_threshold >= 1 (got 0)",
        ),
        (
            {"trainer.rollout_mode": "async", "algorithm.adv_estimator": "remax"},
            "trainer.partial_rollout: algorithm.adv_estimator='remax' needs a greedy baseline",
        ),
        (
            {"trainer.rollout_mode": "async", "actor_rollout_ref.rollout.multi_turn.enable": True},
            "actor_rollout_ref.rollout.multi_turn.enable must be False",
        ),
    ],
)
def test_partial_rollout_is_refused_where_it_cannot_apply(changes, expected):
    c = load_config_file("tiny")
    c.data.train_files, c.data.val_files = __file__, ""
    c.trainer.partial_rollout = True
    c.update_from_flattened_dict(changes)
    with pytest.raises(ConfigError) as err:
        validate(c, 8)
    assert expected in str(err.value)
