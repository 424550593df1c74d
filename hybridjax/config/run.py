"""The resolved run: what the validated ConfigDict implies, computed once, in one frozen object.

    run = resolve(cfg, actor_model, steps_per_epoch)   # after `checks.validate(cfg, ...)`
    run.roles.reference, run.data_parallel, run.batch_sharding, run.stage_cfg, ...

Every derived fact has its home here: which models the run has (`Roles`), how many batch
shards a training mesh has (`data_parallel_size`), where batch rows live (`batch_sharding`),
the placement of the roles on device pools and their meshes, the frozen `StageConfig` of the
jitted passes on each pool, and why the actor update is off-policy. The trainer, the step and
the memory planner read these instead of deriving them again from the ConfigDict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh, NamedSharding
from ml_collections import ConfigDict

from hybridjax.models.config import ModelConfig
from hybridjax.sharding.mesh import HybridMeshes
from hybridjax.sharding.pools import make_placement
from hybridjax.sharding.roles import Roles, batch_sharding, data_parallel_size
from hybridjax.training.build import dtype_of, off_policy_reasons, stage_config


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The run as the trainer builds it (see the module docstring).

    Attributes:
      cfg: the validated ConfigDict (keys read as they are, e.g. `trainer.save_freq`).
      actor_model: the actor's `ModelConfig`.
      roles: which models the run has.
      total_steps: RL steps of the run (`trainer.total_training_steps`, else epochs × batches).
      placement: the roles' device pools (`hybridjax.sharding.pools.Placement`).
      meshes: the actor pool's training mesh and the rollout pool's generation mesh.
      data_parallel: batch shards of the actor's training mesh.
      batch_sharding: batch rows on the actor's training mesh.
      role_meshes: training meshes of `ref`, `teacher`, `critic`, `reward_model` on pools of
        their own.
      pool_batch_shardings: batch rows on those meshes.
      stage_cfg: the `StageConfig` of the passes on the actor's pool.
      role_stage_cfgs: the `StageConfig` of `ref` / `teacher` / `critic` on pools of their own.
      off_policy_reasons: why the actor update is not exactly on-policy (empty: it is).
    """

    cfg: ConfigDict
    actor_model: ModelConfig
    roles: Roles
    total_steps: int
    placement: Any
    meshes: HybridMeshes
    data_parallel: int
    batch_sharding: NamedSharding
    role_meshes: Mapping[str, Mesh]
    pool_batch_shardings: Mapping[str, NamedSharding]
    stage_cfg: Any
    role_stage_cfgs: Mapping[str, Any]
    off_policy_reasons: tuple[str, ...]

    def stage_config_of(self, role: str) -> Any:
        """The `StageConfig` of `role`'s pool (`ref`, `teacher`, `critic`): micro-batches and
        packing follow that pool's data parallelism; the actor's `stage_cfg` when they share one."""
        return self.role_stage_cfgs.get(role, self.stage_cfg)


# the config's dtype keys that accept `auto` (`resolve_dtypes`)
DTYPE_KEYS = (
    "actor_rollout_ref.model.dtype",
    "actor_rollout_ref.rollout.dtype",
    "actor_rollout_ref.ref.fsdp_config.model_dtype",
    "reward_model.model.dtype",
)


def resolve_dtypes(cfg: ConfigDict, backend: str | None = None) -> ConfigDict:
    """Replaces, in place, every `auto` among `DTYPE_KEYS` by `dtype_of(auto, backend)`, so
    the checks, the models, the engine and the planner all read the dtype the run uses; returns
    `cfg`. The trainer calls it on its own backend before checking the config, the planner on
    the backend it plans for (`--target`)."""
    for key in DTYPE_KEYS:
        *path, leaf = key.split(".")
        node = cfg
        for part in path:
            node = node[part]
        node[leaf] = dtype_of(node[leaf], backend)
    return cfg


def total_steps(cfg: ConfigDict, steps_per_epoch: int) -> int:
    """`trainer.total_training_steps` when > 0, else `trainer.total_epochs` × batches."""
    t = cfg.trainer
    return (
        t.total_training_steps if t.total_training_steps > 0 else steps_per_epoch * t.total_epochs
    )


def resolve(
    cfg: ConfigDict,
    actor_model: ModelConfig,
    steps_per_epoch: int,
    devices: Sequence[Any] | None = None,
) -> RunConfig:
    """The `RunConfig` of a validated config on `devices` (default: this process's devices).

    Args:
      cfg: a ConfigDict that `hybridjax.config.checks.validate` accepted.
      actor_model: the actor's `ModelConfig` (sizes packed rows).
      steps_per_epoch: batches of the training loader (`len(loader)`).
      devices: the devices the pools split (the memory planner plans on the first N).
    """
    placement = make_placement(cfg, devices)
    meshes = placement.meshes()
    steps = total_steps(cfg, steps_per_epoch)
    role_meshes = {
        role: placement.train_mesh(role)
        for role in ("ref", "teacher", "critic", "reward_model")
        if placement.roles[role] != placement.roles["actor"]
    }
    stage = lambda mesh: stage_config(cfg, steps, data_parallel_size(mesh), actor_model, mesh)
    return RunConfig(
        cfg=cfg,
        actor_model=actor_model,
        roles=Roles.from_config(cfg),
        total_steps=steps,
        placement=placement,
        meshes=meshes,
        data_parallel=data_parallel_size(meshes.train),
        batch_sharding=batch_sharding(meshes.train),
        role_meshes=role_meshes,
        pool_batch_shardings={role: batch_sharding(m) for role, m in role_meshes.items()},
        stage_cfg=stage(meshes.train),
        role_stage_cfgs={r: stage(m) for r, m in role_meshes.items() if r != "reward_model"},
        off_policy_reasons=tuple(off_policy_reasons(cfg)),
    )
