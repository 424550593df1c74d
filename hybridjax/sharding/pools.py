"""Resource pools (verl's word): named sets of devices, each with its own meshes, and the
placement of every role on a pool.

    resource_pool.<name>.n_devices      devices of the pool (-1: the devices no other pool takes)
    resource_pool.<name>.train / .generate   optional mesh shapes; default `mesh.train` /
                                        `mesh.generate`, where -1 resolves within the pool
    placement.<role>                    the pool of `actor` (training), `rollout` (generation),
                                        `ref`, `critic`, `reward_model`, `teacher` (the
                                        distillation teacher; "" = the pool of `ref`)

Pools take consecutive slices of `jax.devices()` in the order of their names (ConfigDict keeps
its keys sorted), in flat device order (which under
`jax.distributed` spans every process), so a pool can later span hosts. The default is one pool,
`global_pool`, holding every device and every role: the hybrid engine co-located, as before.

Pools live in one process for now (several pools under `jax.distributed` are refused).
Between pools, data and weights move by `jax.device_put` into the destination's shardings; JAX
dispatches asynchronously, so work on disjoint pools overlaps while the controller does not
block. `sync_weights` re-lays the actor's weights from the training pool into the rollout pool's
generation layout (within one pool it is `update_weights`, a jitted re-layout); `move_rows`
sends per-row batch arrays to another pool's batch axes (the reference, teacher and critic
passes on their own pools: inputs there, per-token outputs back).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from hybridjax.sharding.mesh import (
    GENERATE_AXES,
    TRAIN_AXES,
    HybridMeshes,
    MeshConfig,
    make_meshes,
    train_tuple,
)
from hybridjax.sharding.reshard import update_weights
from hybridjax.sharding.roles import Roles

ROLES = ("actor", "rollout", "ref", "critic", "reward_model", "teacher")
DEFAULT_POOL = "global_pool"
POOL_KEYS = {"n_devices", "train", "generate"}


@dataclasses.dataclass(frozen=True)
class Pool:
    """One resource pool: its name, its devices (flat order) and its two mesh shapes."""

    name: str
    devices: tuple[Any, ...]
    mesh: MeshConfig


@dataclasses.dataclass(frozen=True)
class Placement:
    """The run's pools (in config order) and the pool of each role."""

    pools: tuple[Pool, ...]
    roles: Mapping[str, str]  # role -> pool name

    @property
    def co_located(self) -> bool:
        """True when the actor trains and the rollout generates on the same pool."""
        return self.roles["actor"] == self.roles["rollout"]

    def pool(self, role: str) -> Pool:
        """The pool of `role` (one of `ROLES`)."""
        name = self.roles[role]
        return next(p for p in self.pools if p.name == name)

    def train_mesh(self, role: str):
        """The training-layout mesh of `role`'s pool (forward passes use it too)."""
        pool = self.pool(role)
        return make_meshes(pool.mesh, pool.devices).train

    def meshes(self) -> HybridMeshes:
        """(training mesh of the actor's pool, generation mesh of the rollout's pool): with one
        pool these are `make_meshes(mesh config)` over every device, as without pools."""
        actor, rollout = self.pool("actor"), self.pool("rollout")
        train = make_meshes(actor.mesh, actor.devices).train
        return HybridMeshes(
            train=train, generate=make_meshes(rollout.mesh, rollout.devices).generate
        )


def role_pools(cfg: Any) -> dict[str, str]:
    """Role → the name of its pool (`placement.<role>`); `placement.teacher` "" resolves to
    `placement.ref` (the teacher shares the reference's pool unless given one)."""
    out = {role: cfg.placement[role] for role in ROLES}
    out["teacher"] = out["teacher"] or out["ref"]
    return out


def _pool_mesh(cfg: Any, pool: Mapping[str, Any]) -> MeshConfig:
    """The pool's own `train` / `generate` shapes where given, else `mesh.*`."""
    train, generate = dict(cfg.mesh.train), dict(cfg.mesh.generate)
    train |= dict(pool.get("train", {}))
    generate |= dict(pool.get("generate", {}))
    return MeshConfig(
        train=train_tuple(train),
        generate=tuple(int(generate[a]) for a in GENERATE_AXES),  # type: ignore[arg-type]
    )


def _users(cfg: Any, name: str) -> str:
    roles = [r for r, pool in role_pools(cfg).items() if pool == name]
    return f"roles {roles}" if roles else "no role"


def pool_sizes(cfg: Any, n_devices: int) -> tuple[dict[str, int], list[str]]:
    """Each pool's device count (the -1 pool gets the rest) and the problems found: unknown
    pool keys, counts that are 0 or below -1, more than one -1, counts that do not add up to
    `n_devices`, and placements naming no pool. Messages name the pool and the role."""
    problems, sizes = [], {}
    pools = dict(cfg.resource_pool)
    if not pools:
        return {}, ["resource_pool: define at least one pool (default: global_pool.n_devices=-1)"]
    for name, pool in pools.items():
        unknown = sorted(set(dict(pool)) - POOL_KEYS)
        if unknown:
            problems.append(
                f"resource_pool.{name}: unknown keys {unknown} (valid: {sorted(POOL_KEYS)})"
            )
        for layout, axes in (("train", TRAIN_AXES), ("generate", GENERATE_AXES)):
            extra = sorted(set(dict(pool.get(layout, {}))) - set(axes))
            if extra:
                problems.append(
                    f"resource_pool.{name}.{layout}: unknown axes {extra} (valid: {list(axes)})"
                )
        count = pool.get("n_devices", -1)
        if not isinstance(count, int) or isinstance(count, bool) or count == 0 or count < -1:
            problems.append(
                f"resource_pool.{name}.n_devices: must be a positive int or -1 (got {count!r})"
            )
            count = 1
        sizes[name] = count
    free = [n for n, s in sizes.items() if s == -1]
    fixed = sum(s for s in sizes.values() if s != -1)
    if len(free) > 1:
        problems.append(f"resource_pool: at most one pool may have n_devices=-1 (got {free})")
    elif free and fixed >= n_devices:
        problems.append(
            f"resource_pool.{free[0]}.n_devices=-1 gets no device: the other pools take "
            f"{fixed} of the {n_devices} devices"
        )
    elif free:
        sizes[free[0]] = n_devices - fixed
    elif fixed != n_devices:
        listing = ", ".join(f"{n}={s}" for n, s in sizes.items())
        problems.append(
            f"resource_pool n_devices ({listing}) add up to {fixed}, not the {n_devices} devices"
        )
    for role, name in role_pools(cfg).items():
        if name not in pools:
            problems.append(f"placement.{role}: no pool named {name!r} (pools: {list(pools)})")
    return sizes, problems


_UNUSED = {
    "ref": "no KL term (actor.use_kl_loss, algorithm.use_kl_in_reward)",
    "teacher": "no distillation teacher (actor_rollout_ref.distillation.enabled is off)",
    "critic": "critic.enable is off",
    "reward_model": "no reward model on devices: reward_model.enable off or model.path empty",
}


def used_roles(cfg: Any) -> set[str]:
    """The roles that run on devices with this config: actor and rollout always, `ref` with a
    KL term, `teacher` with on-policy distillation, `critic` with `critic.enable`,
    `reward_model` with a loaded (not served) model."""
    roles = Roles.from_config(cfg)
    used = {"actor", "rollout"}
    used |= {"ref"} if roles.reference else set()
    used |= {"teacher"} if roles.teacher else set()
    used |= {"critic"} if roles.critic else set()
    return used | ({"reward_model"} if roles.reward_model else set())


def placement_problems(cfg: Any, n_devices: int) -> list[str]:
    """Every pool / placement problem of `cfg` on `n_devices` devices, each naming the pool and
    its roles: pool sizes (see `pool_sizes`), mesh shapes against pool sizes, roles that must
    share the actor's pool, and async rollout modes on one shared pool. The batch checks per
    pool are `hybridjax.sharding.validate.parallelism_problems` on `pool_config`."""
    sizes, problems = pool_sizes(cfg, n_devices)
    if problems:
        return problems
    for name, pool in dict(cfg.resource_pool).items():
        if len(sizes) == 1:  # every device: `parallelism_problems` checks mesh.* as before
            break
        mesh = _pool_mesh(cfg, pool)
        for layout in ("train", "generate"):
            try:
                getattr(mesh, f"{layout}_sizes")(sizes[name])
            except ValueError as err:
                problems.append(
                    f"resource_pool.{name} ({sizes[name]} devices, {_users(cfg, name)}): "
                    f"{layout} mesh: {err}"
                )
    actor_pool = cfg.placement.actor
    used = used_roles(cfg)
    for name in sizes:
        roles = [r for r, pool in role_pools(cfg).items() if pool == name]
        if roles and not set(roles) & used:
            problems.append(
                f"resource_pool.{name} ({sizes[name]} devices) holds only {roles}, which this "
                f"config does not use ({'; '.join(_UNUSED[r] for r in roles)}): place "
                f"{'them' if len(roles) > 1 else 'it'} on a pool in use or drop the pool"
            )
    mode = cfg.trainer.rollout_mode
    if mode != "sync" and cfg.placement.rollout == actor_pool:
        problems.append(
            f"trainer.rollout_mode={mode!r} needs the rollout on its own pool: placement.rollout "
            f"and placement.actor are both {actor_pool!r} (generation and training would share "
            "the devices, so nothing overlaps); split the pools or use 'sync'"
        )
    return problems


def pool_config(cfg: Any, pool_name: str, n_devices: int) -> Any:
    """A copy of `cfg` whose `mesh.*` are the shapes of `pool_name` (for the per-pool batch and
    mesh checks of `parallelism_problems`, run with the pool's device count)."""
    pool = dict(cfg.resource_pool)[pool_name]
    mesh = _pool_mesh(cfg, pool)
    out = cfg.copy_and_resolve_references()
    out.mesh.train.update(dict(zip(TRAIN_AXES, mesh.train, strict=True)))
    out.mesh.generate.update(dict(zip(GENERATE_AXES, mesh.generate, strict=True)))
    return out


def make_placement(cfg: Any, devices: Sequence[Any] | None = None) -> Placement:
    """The pools over `devices` (default `jax.devices()`), consecutive slices in name order.

    Raises:
      ValueError: listing `placement_problems` (the trainer checks them earlier, with the rest
        of the config); several pools in a multi-process run.
    """
    devices = tuple(jax.devices() if devices is None else devices)
    problems = placement_problems(cfg, len(devices))
    if problems:
        raise ValueError("invalid placement:\n  " + "\n  ".join(problems))
    sizes, _ = pool_sizes(cfg, len(devices))
    if len(sizes) > 1 and jax.process_count() > 1:
        raise ValueError(
            f"resource_pool: {len(sizes)} pools under jax.distributed ({jax.process_count()} "
            "processes) are not supported yet; use one pool (global_pool.n_devices=-1)"
        )
    pools, start = [], 0
    for name, pool in dict(cfg.resource_pool).items():
        pools.append(Pool(name, devices[start : start + sizes[name]], _pool_mesh(cfg, pool)))
        start += sizes[name]
    return Placement(tuple(pools), role_pools(cfg))


def move_rows(rows: Any, sharding: Sharding) -> tuple[Any, int]:
    """Per-row arrays (a pytree, e.g. an `RLBatch`; None leaves stay None) into `sharding`, the
    batch axes of another pool's mesh: one `jax.device_put` per leaf, device to device (no host
    round trip), dispatched asynchronously. A copy, so the values are bit-exact.

    Args:
      rows: pytree of `jax.Array`s, each with the batch dimension first.
      sharding: the destination, e.g. `NamedSharding(pool_mesh, PartitionSpec(("data", "fsdp")))`.
    Returns:
      (the moved pytree, bytes written over every destination device: `perf/transfer_bytes`).
    """
    moved = jax.device_put(rows, sharding)
    return moved, _written_bytes(moved)


def _written_bytes(tree: Any) -> int:
    """Bytes held by the arrays of `tree` summed over their devices (replicas count)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shard)) * leaf.dtype.itemsize * len(leaf.sharding.device_set)
    return total


def sync_weights(
    params: Any, shardings: Any, dtype: Any = None, forward: bool = False
) -> tuple[Any, int]:
    """The actor's weights in the rollout's generation layout, across pools or within one.

    Within one device set this is `update_weights` (one jitted re-layout per leaf). Across
    pools each floating leaf is cast on its source devices (so a float32 → bfloat16 sync sends
    half the bytes), then `jax.device_put` into its destination sharding: a copy, so the values
    are bit-exact (up to the cast). Dispatch is asynchronous: the host does not wait for the
    copies (the consumer's first use does).

    Args:
      params: pytree of `jax.Array`s (the actor's params in the training layout).
      shardings: matching pytree of destination `Sharding`s (e.g. `state_shardings(params,
        rollout_generate_mesh, ACTOR_GENERATE_RULES)`).
      dtype: destination dtype of floating leaves, or None to keep them.
      forward: within one device set, leaves already in their destination layout and dtype
        come back as they are, sharing the source's buffers (`update_weights`).
    Returns:
      (the moved pytree, bytes written summed over every destination device: `perf/reshard_bytes`).
    Raises:
      ValueError: `shardings` does not match `params`.
    """
    leaves = jax.tree.leaves(params)
    targets = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, Sharding))
    if len(leaves) != len(targets):
        raise ValueError(f"shardings ({len(targets)} leaves) do not match params ({len(leaves)})")
    if all(
        leaf.sharding.device_set == t.device_set for leaf, t in zip(leaves, targets, strict=True)
    ):
        return update_weights(params, shardings, dtype, forward=forward)

    def cast(x):
        floating = jnp.issubdtype(x.dtype, np.floating)
        return x.astype(dtype) if dtype is not None and floating and x.dtype != dtype else x

    moved = jax.device_put(jax.tree.map(cast, params), shardings)
    return moved, _written_bytes(moved)
