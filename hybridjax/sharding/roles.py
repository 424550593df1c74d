"""Facts every part of a run derives from its config: which models it has, and how a training
mesh splits batch rows. Each is computed here and only here (`hybridjax.config.run` gathers
them into the run's `RunConfig`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybridjax.sharding.mesh import BATCH_AXES, batch_shards


@dataclasses.dataclass(frozen=True)
class Roles:
    """Which models a run has besides the actor and its rollout.

    Attributes:
      reference: a reference policy, for a KL term (`actor_rollout_ref.actor.use_kl_loss` or
        `algorithm.use_kl_in_reward`).
      critic: a value model (`critic.enable`).
      reward_model: a reward model on the devices (`reward_model.enable` with a
        `reward_model.model.path`; with an empty path it is served, `reward_model.remote`).
      teacher: an on-policy distillation teacher (`actor_rollout_ref.distillation.enabled`),
        on its pool (`placement.teacher`).
    """

    reference: bool
    critic: bool
    reward_model: bool
    teacher: bool = False

    @classmethod
    def from_config(cls, cfg: Any) -> Roles:
        """The roles of a trainer ConfigDict (or nested dict with the same keys)."""
        rm = cfg.reward_model
        return cls(
            reference=bool(
                cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
            ),
            critic=bool(cfg.critic.enable),
            reward_model=bool(rm.enable and rm.model.path),
            teacher=bool(cfg.actor_rollout_ref.distillation.enabled),
        )


def data_parallel_size(mesh: Mesh) -> int:
    """Batch shards of a training mesh: `data` × `expert` × `fsdp` (each holds rows of its
    own; `expert` ranks are data-parallel ranks outside the MoE layers)."""
    return batch_shards(mesh.shape)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows of a batch split over a training mesh's batch axes (`data` × `expert` × `fsdp`)."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))
