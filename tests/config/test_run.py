"""The resolved run config: roles, data parallelism, batch shardings and per-pool stage configs
computed once from a validated config; the head-count check runs on its own, once."""

from __future__ import annotations

import dataclasses

import pytest
from jax.sharding import PartitionSpec

from hybridjax.config.checks import ConfigError
from hybridjax.config.run import resolve, resolve_dtypes, total_steps
from hybridjax.models.config import ModelConfig
from hybridjax.rl.checks import validate, validate_models
from hybridjax.sharding.roles import Roles
from hybridjax.training.build import dtype_of
from tests.rl.tiny_run import load_config_file

ACTOR = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip


def _tiny(**changes):
    c = load_config_file("tiny")
    c.data.train_files = __file__  # any existing file
    c.data.val_files = ""
    c.update_from_flattened_dict(changes)
    return c


@pytest.mark.parametrize(
    "changes, roles",
    [
        ({}, Roles(reference=False, critic=True, reward_model=False)),
        (
            {"actor_rollout_ref.actor.use_kl_loss": True, "critic.enable": False},
            Roles(True, False, False),
        ),
        ({"algorithm.use_kl_in_reward": True}, Roles(True, True, False)),
        ({"reward_model.enable": True}, Roles(False, True, False)),  # served: no model path
        ({"reward_model.enable": True, "reward_model.model.path": "rm"}, Roles(False, True, True)),
        ({"actor_rollout_ref.distillation.enabled": True}, Roles(False, True, False, teacher=True)),
    ],
)  # fmt: skip
def test_roles_follow_the_keys_that_make_them(changes, roles):
    assert Roles.from_config(_tiny(**changes)) == roles


def test_resolve_on_one_pool():
    c = _tiny(**{"mesh.train.fsdp": 4, "mesh.train.data": 2, "mesh.generate.data": 8})
    validate(c, 8)
    run = resolve(c, ACTOR, steps_per_epoch=5)
    assert run.data_parallel == 8
    assert run.batch_sharding.spec == PartitionSpec(("data", "expert", "fsdp"))
    assert run.batch_sharding.mesh.shape["fsdp"] == 4
    assert run.role_meshes == {} and run.pool_batch_shardings == {} and run.role_stage_cfgs == {}
    assert run.stage_config_of("critic") is run.stage_cfg
    assert run.stage_cfg.head.mesh is run.meshes.train  # the LM head runs vocab-parallel on it
    n = c.actor_rollout_ref.rollout.n
    assert (
        run.stage_cfg.actor_update.mini_batch_size
        == c.actor_rollout_ref.actor.ppo_mini_batch_size * n
    )
    assert run.total_steps == total_steps(c, 5)


def test_resolve_gives_a_critic_on_its_own_pool_its_own_stage_config():
    c = _tiny()
    c.resource_pool = dict(critic_pool=dict(n_devices=2), gen=dict(n_devices=2), train=dict())
    c.resource_pool.train.n_devices = 4
    c.placement.update(dict(actor="train", ref="train", reward_model="train", rollout="gen"))
    c.placement.critic = "critic_pool"
    validate(c, 8)
    run = resolve(c, ACTOR, steps_per_epoch=5)
    assert set(run.role_meshes) == {"critic"} == set(run.pool_batch_shardings)
    assert run.data_parallel == 4 and run.role_meshes["critic"].size == 2
    critic = run.stage_config_of("critic")
    assert critic is not run.stage_cfg
    assert critic.head.mesh is run.role_meshes["critic"]
    assert critic.critic_update.micro_batch_size * 2 == run.stage_cfg.critic_update.micro_batch_size


def test_total_steps():
    c = _tiny(**{"trainer.total_training_steps": -1, "trainer.total_epochs": 3})
    assert total_steps(c, 7) == 21
    c.trainer.total_training_steps = 4
    assert total_steps(c, 7) == 4


def test_head_counts_are_checked_once_on_their_own():
    c = _tiny(**{"mesh.train.tensor": 4, "mesh.train.fsdp": 2, "mesh.generate.tensor": 4})
    validate(c, 8)  # the config alone fits
    heads = dataclasses.replace(ACTOR, num_key_value_heads=2)
    with pytest.raises(ConfigError, match=r"num_key_value_heads = 2 is not divisible by mesh"):
        validate_models(c, 8, {"actor_rollout_ref.model": heads})
    validate_models(
        c, 8, {"actor_rollout_ref.model": dataclasses.replace(heads, num_key_value_heads=4)}
    )


def _moe_actor():
    """The tiny actor as a 4-expert, top-2 Qwen3-MoE."""
    return dataclasses.replace(
        ACTOR, family="qwen3_moe", attention_bias=False, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=8,
    )  # fmt: skip


def test_expert_axis_is_checked_against_the_models():
    """`mesh.train.expert=2` from the config: a dense actor is rejected, a MoE one whose
    experts it divides is accepted, and batch rows split over data × expert × fsdp."""
    c = _tiny(**{"mesh.train.expert": 2})
    validate(c, 8)
    with pytest.raises(ConfigError, match=r"mesh.train.expert = 2 needs a mixture-of-experts"):
        validate_models(c, 8, {"actor_rollout_ref.model": ACTOR})
    moe = _moe_actor()
    validate_models(c, 8, {"actor_rollout_ref.model": moe})
    run = resolve(c, moe, steps_per_epoch=1)
    assert dict(run.meshes.train.shape) == {"data": 1, "expert": 2, "fsdp": 4, "tensor": 1}
    assert run.data_parallel == 8


def test_router_replay_r3_needs_a_mixture_of_experts_actor():
    c = _tiny(**{
        "actor_rollout_ref.actor.router_replay.mode": "R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
        "actor_rollout_ref.model.use_remove_padding": False,
    })  # fmt: skip
    validate(c, 8)
    with pytest.raises(ConfigError, match=r"R3' replays the experts of a mixture-of-experts"):
        validate_models(c, 8, {"actor_rollout_ref.model": ACTOR})
    moe = _moe_actor()
    validate_models(c, 8, {"actor_rollout_ref.model": moe})


@pytest.mark.parametrize(
    "backend, dtype",
    [("gpu", "bfloat16"), ("cuda", "bfloat16"), ("rocm", "bfloat16"), ("tpu", "bfloat16"),
     ("cpu", "float32")],
)  # fmt: skip
def test_auto_is_the_backends_compute_dtype(backend, dtype):
    assert dtype_of("auto", backend) == dtype
    assert dtype_of("float16", backend) == "float16"  # a named dtype stays


def test_resolve_dtypes_replaces_every_auto_in_place():
    c = _tiny(**{"actor_rollout_ref.ref.fsdp_config.model_dtype": "auto"})
    assert c.actor_rollout_ref.model.dtype == c.actor_rollout_ref.rollout.dtype == "auto"
    assert resolve_dtypes(c, "gpu") is c
    a = c.actor_rollout_ref
    assert a.model.dtype == a.rollout.dtype == a.ref.fsdp_config.model_dtype == "bfloat16"
    assert c.reward_model.model.dtype == "float32"  # its default stays float32
    c = resolve_dtypes(_tiny(), "cpu")  # the CPU tests' float32
    assert c.actor_rollout_ref.model.dtype == c.actor_rollout_ref.rollout.dtype == "float32"
    assert dtype_of("auto") == "float32"  # this process's backend: the test suite's CPU


def test_auto_reference_with_lora_is_checked_as_it_resolves():
    c = _tiny(**{"actor_rollout_ref.model.lora_rank": 4})
    c.actor_rollout_ref.ref.fsdp_config.model_dtype = "auto"  # float32 on this CPU backend
    c.actor_rollout_ref.actor.use_kl_loss = True
    validate(c, 8)
    with pytest.raises(ConfigError, match="base weights"):
        validate(resolve_dtypes(c, "gpu"), 8)
