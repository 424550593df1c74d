"""Offloaded states live in host memory and are on the devices only while a stage uses them
(verl's offload keys, which verl applies around each compute call).

`actor_rollout_ref.actor.fsdp_config.{param,optimizer}_offload`,
`actor_rollout_ref.ref.fsdp_config.param_offload`,
`actor_rollout_ref.distillation.teacher_model.fsdp_config.param_offload` and
`critic.model.fsdp_config.*` name the states that move (`pipeline.MODEL_STATES`: `actor`,
`actor_optimizer`, `ref`, `teacher`, `critic`, `critic_optimizer`). Every stage of the step
declares the states it reads (`Stage.uses`); before it runs, `step.place_offloaded` puts the
offloaded ones it uses on the devices and the other offloaded ones in host memory, moving only
what is not already there (`misplaced`). So the rollout runs with all of them in host memory,
`update_critic` without the actor's optimizer state, `update_actor` without the reference,
teacher or critic, and the last stage (`onload`, which uses them all) brings them back for what
runs between steps (checkpoints, validation). A stage that declares nothing (`uses=None`, a
user's stage unless it says) leaves them where they are. `hybridjax.sharding.offload_to_host`
/ `load_to_device` move the arrays, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
from ml_collections import ConfigDict

from hybridjax.sharding import OffloadConfig
from hybridjax.training.build import Models


def offload_configs(cfg: ConfigDict) -> dict[str, OffloadConfig]:
    """Role (`actor`, `ref`, `teacher`, `critic`) → which of its states are offloaded."""
    a = cfg.actor_rollout_ref
    return {
        "actor": OffloadConfig.from_config(a.actor.fsdp_config),
        "ref": OffloadConfig.from_config(a.ref.fsdp_config),
        "teacher": OffloadConfig.from_config(a.distillation.teacher_model.fsdp_config),
        "critic": OffloadConfig.from_config(cfg.critic.model.fsdp_config),
    }


def offloaded_states(offload: Mapping[str, OffloadConfig]) -> frozenset[str]:
    """The names in `MODEL_STATES` that the offload keys keep in host memory between their uses."""
    names = set()
    for role, o in offload.items():
        if o.param_offload:
            names.add(role)
        if o.optimizer_offload and role in ("actor", "critic"):
            names.add(f"{role}_optimizer")
    return frozenset(names)


def any_offload(offload: Mapping[str, OffloadConfig]) -> bool:
    """True when any role offloads its parameters or optimizer state."""
    return bool(offloaded_states(offload))


def _get(models: Models, name: str) -> Any:
    role, _, part = name.partition("_")
    if role in ("actor", "critic"):
        state = models.actor_state if role == "actor" else models.critic_state
        return None if state is None else (state.opt_state if part else state.params)
    if role == "teacher":
        return None if models.teacher is None else models.teacher[1]
    return models.ref_params


def _set(models: Models, name: str, tree: Any) -> Models:
    role, _, part = name.partition("_")
    if role in ("actor", "critic"):
        field = f"{role}_state"
        state = dataclasses.replace(
            getattr(models, field), **{"opt_state" if part else "params": tree}
        )
        return dataclasses.replace(models, **{field: state})
    if role == "teacher":
        return dataclasses.replace(models, teacher=(models.teacher[0], tree))
    return dataclasses.replace(models, ref_params=tree)


def _nbytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def _in_host_memory(tree: Any) -> bool:
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)}
    return bool(kinds - {None, "device"})


def move_states(
    models: Models, names: Iterable[str], move: Callable[[Any], Any]
) -> tuple[Models, int]:
    """`models` with the states `names` (of `MODEL_STATES`; absent ones skipped) passed through
    `move` (`offload_to_host` or `load_to_device`), and the bytes of those states (all
    devices). Host sync: waits for the copies."""
    moved = 0
    for name in names:
        tree = _get(models, name)
        if tree is not None:
            models, moved = _set(models, name, move(tree)), moved + _nbytes(tree)
    return models, moved


def move_idle_states(
    models: Models, offload: Mapping[str, OffloadConfig], move: Callable[[Any], Any]
) -> Models:
    """`models` with every state the offload keys name passed through `move`. Host sync."""
    return move_states(models, sorted(offloaded_states(offload)), move)[0]


def misplaced(
    models: Models, offloaded: frozenset[str], uses: Iterable[str]
) -> tuple[list[str], list[str]]:
    """For a stage that uses the states `uses`: (the `offloaded` states it does not use that
    are on the devices, the `offloaded` states it uses that are in host memory). With LoRA the
    reference is the actor's base, so `ref` uses `actor`. Absent states are neither."""
    uses = set(uses) | ({"actor"} if "ref" in uses and models.ref_is_base else set())
    present = lambda names: [n for n in sorted(names) if _get(models, n) is not None]
    away = [n for n in present(offloaded - uses) if not _in_host_memory(_get(models, n))]
    back = [n for n in present(offloaded & uses) if _in_host_memory(_get(models, n))]
    return away, back
