"""Offloaded model states are on the devices only in the stages that use them (`Stage.uses`;
`step.place_offloaded` before each stage `train_step` calls): each stage of the default PPO
step with a reference, a teacher and a critic, every offload key on, sees exactly its own
states in device memory; the bytes and the moves are counted; a state no key names never
moves; a stage that declares nothing moves nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from hybridjax.config.schema import base_config
from hybridjax.rl import step
from hybridjax.rl.pipeline import PipelineError, Record, Stage
from hybridjax.training.build import Models
from hybridjax.training.offload import offload_configs

OFFLOAD_KEYS = (
    "actor_rollout_ref.actor.fsdp_config.param_offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    "actor_rollout_ref.ref.fsdp_config.param_offload",
    "actor_rollout_ref.distillation.teacher_model.fsdp_config.param_offload",
    "critic.model.fsdp_config.param_offload",
    "critic.model.fsdp_config.optimizer_offload",
)


@dataclasses.dataclass(frozen=True)
class State:  # the two fields of a TrainState the offload reads
    params: Any
    opt_state: Any


def _models() -> Models:
    x = lambda n: {"w": jnp.full((n,), 1.0, jnp.float32)}  # n × 4 bytes
    return Models(
        actor_graphdef=None,
        actor_state=State(x(1), x(2)),
        ref_params=x(4),
        critic_graphdef=None,
        critic_state=State(x(8), x(16)),
        reward_model=None,
        teacher=(None, x(32)),
    )


def _where(models: Models) -> dict[str, str]:
    trees = {
        "actor": models.actor_state.params,
        "actor_optimizer": models.actor_state.opt_state,
        "ref": models.ref_params,
        "teacher": models.teacher[1],
        "critic": models.critic_state.params,
        "critic_optimizer": models.critic_state.opt_state,
    }
    kind = lambda t: jax.tree.leaves(t)[0].sharding.memory_kind
    return {k: "device" if kind(t) in (None, "device") else "host" for k, t in trees.items()}


def _config(*offloaded: str):
    c = base_config()
    c.critic.enable = True
    c.actor_rollout_ref.actor.use_kl_loss = True
    c.actor_rollout_ref.distillation.enabled = True
    for key in offloaded:
        c.update_from_flattened_dict({key: True})
    return c


class _Placing:
    """The models of one step and its record, placed stage after stage as `train_step` does."""

    def __init__(self, cfg):
        self.offload, self.models, self.rec = offload_configs(cfg), _models(), Record()
        self.metrics, self.timing = self.rec.metrics, self.rec.timing

    def place(self, stage: Stage) -> None:
        self.models = step.place_offloaded(self.models, stage.uses, self.offload, self.rec)


def _ctx(cfg) -> _Placing:
    return _Placing(cfg)


def test_each_stage_holds_on_the_devices_only_the_states_it_uses():
    cfg = _config(*OFFLOAD_KEYS)
    pipeline = step.default_pipeline(cfg)
    assert pipeline.names[-1] == "onload"
    ctx, seen = _ctx(cfg), {}
    for stage in pipeline.stages:
        ctx.place(stage)
        seen[stage.name] = {k for k, v in _where(ctx.models).items() if v == "device"}
    assert seen["gen"] == seen["reward"] == set()
    assert seen["old_log_prob"] == {"actor"}
    assert seen["ref"] == {"ref"} and seen["teacher"] == {"teacher"}
    assert seen["values"] == seen["adv"] == {"critic"}  # adv declares nothing: nothing moves
    assert seen["update_critic"] == {"critic", "critic_optimizer"}
    assert seen["update_actor"] == {"actor", "actor_optimizer"}
    assert seen["reshard"] == {"actor"}
    assert seen["onload"] == set(_where(ctx.models))  # all back for what runs between steps
    # bytes moved (4 per float; actor 4, its optimizer 8, ref 16, teacher 128, critic 32, its
    # optimizer 64): gen sends all 252 to host; to the devices: actor 4 (old_log_prob), ref 16,
    # teacher 128, critic 32 (values), its optimizer 64, actor + optimizer 12 (update_actor),
    # then at onload the 248 still in host memory; to host: 252, actor 4 (ref), ref 16,
    # teacher 128, critic + optimizer 96 (update_actor), the actor's optimizer 8 (reshard)
    m = ctx.metrics
    assert m["perf/onload_bytes"] == 4 + 16 + 128 + 32 + 64 + 12 + 248
    assert m["perf/offload_bytes"] == 252 + 4 + 16 + 128 + 96 + 8
    assert ctx.timing["onload"] > 0 and ctx.timing["offload"] > 0


def test_only_what_a_key_names_moves():
    cfg = _config("actor_rollout_ref.actor.fsdp_config.optimizer_offload")
    ctx = _ctx(cfg)
    for stage in step.default_pipeline(cfg).stages:
        ctx.place(stage)
        on_host = {k for k, v in _where(ctx.models).items() if v == "host"}
        used = stage.name in ("update_actor", "onload")
        assert on_host == (set() if used else {"actor_optimizer"}), stage.name


def test_a_stage_that_declares_nothing_moves_nothing():
    cfg = _config(*OFFLOAD_KEYS)
    ctx = _ctx(cfg)
    ctx.place(step.GEN)  # all in host memory
    ctx.place(Stage("mine", lambda b, c: b))
    assert set(_where(ctx.models).values()) == {"host"}
    with pytest.raises(PipelineError, match="unknown model states.*valid: actor"):
        Stage("mine", lambda b, c: b, uses=("actors",))
