"""Idle states to host memory while the rollout runs, and back (verl's offload keys).

`actor_rollout_ref.actor.fsdp_config.{param,optimizer}_offload`,
`actor_rollout_ref.ref.fsdp_config.param_offload`,
`actor_rollout_ref.distillation.teacher_model.fsdp_config.param_offload` and
`critic.model.fsdp_config.*` name what moves; `hybridjax.sharding.offload_to_host` /
`load_to_device` move it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ml_collections import ConfigDict

from hybridjax.rl.build import Models
from hybridjax.sharding import OffloadConfig


def offload_configs(cfg: ConfigDict) -> dict[str, OffloadConfig]:
    """Role (`actor`, `ref`, `teacher`, `critic`) → what of it goes to host memory during
    generation."""
    a = cfg.actor_rollout_ref
    return {
        "actor": OffloadConfig.from_config(a.actor.fsdp_config),
        "ref": OffloadConfig.from_config(a.ref.fsdp_config),
        "teacher": OffloadConfig.from_config(a.distillation.teacher_model.fsdp_config),
        "critic": OffloadConfig.from_config(cfg.critic.model.fsdp_config),
    }


def any_offload(offload: dict[str, OffloadConfig]) -> bool:
    """True when any role offloads its parameters or optimizer state during generation."""
    return any(o.param_offload or o.optimizer_offload for o in offload.values())


def move_idle_states(
    models: Models, offload: dict[str, OffloadConfig], move: Callable[[Any], Any]
) -> Models:
    """`models` with the states configured in `offload` passed through `move`
    (`offload_to_host` before generation, `load_to_device` after). Host sync."""
    states = {"actor": models.actor_state, "critic": models.critic_state}
    for role, state in states.items():
        if state is None:
            continue
        if offload[role].param_offload:
            state = dataclasses.replace(state, params=move(state.params))
        if offload[role].optimizer_offload:
            state = dataclasses.replace(state, opt_state=move(state.opt_state))
        states[role] = state
    ref = models.ref_params
    if ref is not None and offload["ref"].param_offload:
        ref = move(ref)
    teacher = models.teacher
    if teacher is not None and offload["teacher"].param_offload:
        teacher = (teacher[0], move(teacher[1]))
    return dataclasses.replace(
        models,
        actor_state=states["actor"],
        critic_state=states["critic"],
        ref_params=ref,
        teacher=teacher,
    )
