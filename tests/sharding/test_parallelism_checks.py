"""Parallelism checks: one ValueError naming every offending key and its value."""

import dataclasses

import pytest
from ml_collections import ConfigDict
from sharding_testing import TINY

from hybridjax.sharding import check_parallelism, parallelism_problems


def _config(**mesh):
    return ConfigDict(
        dict(
            data=dict(train_batch_size=8),
            actor_rollout_ref=dict(actor=dict(ppo_mini_batch_size=4), rollout=dict(n=2)),
            critic=dict(enable=True, ppo_mini_batch_size=4),
            mesh=dict(
                train=mesh.get("train", dict(data=1, fsdp=-1, tensor=2)),
                generate=mesh.get("generate", dict(data=-1, tensor=2)),
            ),
        )
    )


def test_a_fitting_config_has_no_problems():
    assert parallelism_problems(_config(), 8, {"actor_rollout_ref.model": TINY}) == []
    check_parallelism(_config(), 8, {"actor_rollout_ref.model": TINY})


def test_every_problem_in_one_message():
    # generation 2 × 2 ≠ 8 devices; training data-parallel size 1 × 2 = 2; tensor 4.
    config = _config(train=dict(data=1, fsdp=-1, tensor=4), generate=dict(data=2, tensor=2))
    config.data.train_batch_size = 3
    config.actor_rollout_ref.actor.ppo_mini_batch_size = 1
    config.critic.ppo_mini_batch_size = 1
    config.actor_rollout_ref.rollout.n = 1  # 3, 1 and 1 responses: odd
    model = dataclasses.replace(TINY, num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(ValueError) as err:
        check_parallelism(config, 8, {"actor_rollout_ref.model": model})
    message = str(err.value)
    assert "(6 problems)" in message
    for line in (
        "mesh.generate.data=2, mesh.generate.tensor=2: must multiply to the 8 devices",
        "data.train_batch_size × actor_rollout_ref.rollout.n = 3 × 1 = 3 is not divisible by "
        "the training data-parallel size mesh.train.data × mesh.train.expert × mesh.train.fsdp "
        "= 1 × 1 × 2 = 2",
        "actor_rollout_ref.actor.ppo_mini_batch_size × actor_rollout_ref.rollout.n = 1 × 1 = 1",
        "critic.ppo_mini_batch_size × actor_rollout_ref.rollout.n = 1 × 1 = 1",
        "actor_rollout_ref.model.num_attention_heads = 6 is not divisible by mesh.train.tensor = 4",
    ):
        assert line in message
    # The broken generation mesh is not checked against the head counts.
    assert "mesh.generate.tensor = 2" not in message
    assert "num_key_value_heads = 2 is not divisible by mesh.train.tensor = 4" in message


def test_generation_data_parallel_and_disabled_critic():
    config = _config(train=dict(data=1, fsdp=8, tensor=1), generate=dict(data=8, tensor=1))
    config.data.train_batch_size = 12  # × n=2 = 24: 24 % 8 = 0 → fine
    config.critic.enable = False
    config.critic.ppo_mini_batch_size = 3  # not checked: critic disabled
    assert parallelism_problems(config, 8) == []
    config.data.train_batch_size = 6  # 12 responses over 8 shards
    problems = parallelism_problems(config, 8)
    assert len(problems) == 2
    assert "generation data-parallel size mesh.generate.data = 8" in problems[1]


def test_expert_axis_needs_a_moe_model_whose_experts_it_divides():
    """mesh.train.expert splits the batch like data (8 rows × n=2 over 2 × 2 shards is fine)
    and the experts: dense models alone, or 6 experts over 4, are rejected."""
    moe = dataclasses.replace(
        TINY, family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8
    )
    config = _config(train=dict(data=1, expert=2, fsdp=2, tensor=2))
    assert parallelism_problems(config, 8, {"actor_rollout_ref.model": moe}) == []
    assert (
        parallelism_problems(config, 8, {"actor_rollout_ref.model": moe, "critic.model": TINY})
        == []
    )  # a dense critic beside a MoE actor: expert ranks are data-parallel ranks
    assert parallelism_problems(config, 8, {"actor_rollout_ref.model": TINY}) == [
        "mesh.train.expert = 2 needs a mixture-of-experts model, but actor_rollout_ref.model "
        "is dense (num_experts = 0); use mesh.train.expert=1"
    ]
    config = _config(train=dict(data=1, expert=4, fsdp=1, tensor=2))
    six = dataclasses.replace(moe, num_experts=6)
    assert parallelism_problems(config, 8, {"actor_rollout_ref.model": six}) == [
        "actor_rollout_ref.model.num_experts = 6 is not divisible by mesh.train.expert = 4"
    ]
    config.data.train_batch_size = 3  # × n=2 = 6 rows over data × expert × fsdp = 4 shards
    assert any(
        "mesh.train.data × mesh.train.expert × mesh.train.fsdp = 1 × 4 × 1 = 4" in p
        for p in parallelism_problems(config, 8, {"actor_rollout_ref.model": moe})
    )


def test_two_free_axes_are_named_with_the_default_that_made_them():
    """mesh.train.fsdp is -1 by default: a config that also sets data=-1 is told which two
    axes are free and how to ask for replicated data parallelism."""
    config = _config(train=dict(data=-1, fsdp=-1, tensor=1))
    problems = parallelism_problems(config, 8, {"actor_rollout_ref.model": TINY})
    assert problems == [
        "mesh.train.data=-1, mesh.train.expert=1, mesh.train.fsdp=-1, mesh.train.tensor=1: only "
        "one axis may be -1 (the rest of the devices), not mesh.train.data and mesh.train.fsdp; "
        "give the others a size (mesh.train.fsdp=-1 is the default, parameters sharded over "
        "every device; mesh.train.data=-1 mesh.train.fsdp=1 replicates them instead)"
    ]


def test_the_default_training_mesh_shards_parameters_over_every_device():
    from hybridjax.config.schema import base_config
    from hybridjax.sharding import MeshConfig

    mesh = MeshConfig.from_config(base_config())
    assert mesh.train_sizes(8) == {"data": 1, "expert": 1, "fsdp": 8, "tensor": 1}
    assert mesh.train_sizes(1) == {"data": 1, "expert": 1, "fsdp": 1, "tensor": 1}
