"""Several hosts under `jax.distributed`: start-up, each process's share, host-side gathers.

Every process runs the same program (JAX's multi-controller runtime, as on TPU pods and GPU
clusters); the meshes span every process's devices (`mesh.py`). Host-side work is split by
rows: process p owns the contiguous rows `[p·B/P, (p+1)·B/P)` of every global batch of B
prompts. It collates only those prompts, generates their responses on its own devices (one
generation replica per host: `local_mesh`, weights handed over by `to_local`), and scores them.
What every process needs whole — the responses that make up the global batch, the rewards, the
metrics — is exchanged with `allgather` (one `process_allgather` of pickled bytes), so every
later decision is taken on identical values on every process and none can diverge or wait on a
collective the others never enter. Process 0 alone writes logs, plots and exports; orbax
checkpoints are written by every process together.

The per-host generation replica is what makes the host loop of the rollout engine (continuous
batching, EOS, refills) safe: it reads only arrays on its own devices and decides for its own
rows. Sampling keys depend only on (seed, global prompt index, sample index, step), so the
samples do not depend on how prompts are split over hosts: P processes give the result of one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

log = logging.getLogger(__name__)

ENABLE = ("auto", "on", "off")
# Environment variables that mean "this process is one of several" (JAX auto-detects the rest).
_CLUSTER_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JAX_NUM_PROCESSES")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """`trainer.distributed.*`.

    enable: `auto` starts `jax.distributed` when `num_processes > 1` or a multi-task launcher
      (SLURM, Open MPI) is detected; `on` always (JAX's cluster auto-detection: SLURM, Cloud
      TPU, GKE, MPI, unless the address is given); `off` never (one process).
    coordinator_address: `host:port` of process 0 ("" = auto-detect).
    num_processes, process_id: explicit layout (0 and -1 = auto-detect).
    heartbeat_timeout_s: a process that stops answering for this long ends the others' runs
      (they exit non-zero instead of hanging in a collective).
    initialization_timeout_s: how long to wait for every process to join.
    """

    enable: str = "auto"
    coordinator_address: str = ""
    num_processes: int = 0
    process_id: int = -1
    heartbeat_timeout_s: int = 30
    initialization_timeout_s: int = 300

    @classmethod
    def from_config(cls, config: Any) -> DistributedConfig:
        d = config.trainer.distributed
        out = cls(
            str(d.enable),
            str(d.coordinator_address),
            int(d.num_processes),
            int(d.process_id),
            int(d.heartbeat_timeout_s),
            int(d.initialization_timeout_s),
        )
        if out.enable not in ENABLE:
            raise ValueError(f"trainer.distributed.enable={out.enable!r}; valid: {list(ENABLE)}")
        return out

    def wanted(self) -> bool:
        if self.enable != "auto":
            return self.enable == "on"
        if self.num_processes > 1 or self.coordinator_address:
            return True
        return any(int(os.environ.get(k, "1") or 1) > 1 for k in _CLUSTER_ENV)


def initialize(config: DistributedConfig) -> bool:
    """Starts `jax.distributed` when `config.wanted()`; call before any other JAX call.

    On CPU the cross-process collectives use gloo. Returns whether it started.
    Raises:
      RuntimeError: a peer did not join within `initialization_timeout_s` (JAX's message).
    """
    if not config.wanted():
        return False
    platforms = jax.config.jax_platforms  # type: ignore[attr-defined]
    if "cpu" in os.environ.get("JAX_PLATFORMS", "") or platforms == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address or None,
        num_processes=config.num_processes or None,
        process_id=None if config.process_id < 0 else config.process_id,
        initialization_timeout=config.initialization_timeout_s,
        heartbeat_timeout_seconds=config.heartbeat_timeout_s,
    )
    log.info(
        "process %d of %d; %d local of %d devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


def is_main() -> bool:
    """True on the process that writes logs, plots and exports (process 0)."""
    return jax.process_index() == 0


def process_suffix() -> str:
    """ "" on process 0, ".process<i>" on the others (per-process file names)."""
    return "" if is_main() else f".process{jax.process_index()}"


def share(num_rows: int) -> slice:
    """This process's contiguous rows of a global batch of `num_rows` rows.

    Raises:
      ValueError: `num_rows` is not a multiple of the process count.
    """
    count, index = jax.process_count(), jax.process_index()
    if num_rows % count:
        raise ValueError(f"a batch of {num_rows} rows does not split over {count} processes")
    size = num_rows // count
    return slice(index * size, (index + 1) * size)


def local_mesh(mesh: Mesh) -> Mesh:
    """The block of `mesh` on this process's devices, with the same axis names: this host's
    generation replica. The same mesh when there is one process.

    Raises:
      ValueError: this process's devices are not whole slices along the first axis (a tensor
        group that spans hosts cannot serve a per-host replica).
    """
    if jax.process_count() == 1:
        return mesh
    devices = mesh.devices
    mine = np.vectorize(lambda d: d.process_index == jax.process_index())(devices)
    rows = np.nonzero(mine.reshape(mine.shape[0], -1).any(axis=1))[0]
    if not mine[rows].all() or mine.sum() != mine[rows].size:
        raise ValueError(
            f"mesh {dict(mesh.shape)}: process {jax.process_index()}'s devices do not form whole "
            f"slices along {mesh.axis_names[0]!r}; keep the generation tensor axis within a host"
        )
    return Mesh(devices[rows], mesh.axis_names, axis_types=mesh.axis_types)


def to_local(tree: Any, mesh: Mesh) -> Any:
    """Arrays laid out on a global mesh, replicated along its first axis, as arrays on
    `mesh` = `local_mesh(global)` (no data moves: the local shards are re-wrapped).

    Raises:
      ValueError: a leaf is sharded along the first axis (its local block would be partial).
    """
    if jax.process_count() == 1:
        return tree

    def leaf(x: jax.Array) -> jax.Array:
        spec = x.sharding.spec  # type: ignore[attr-defined]
        if any(mesh.axis_names[0] in (s if isinstance(s, tuple) else (s,)) for s in spec):
            raise ValueError(f"a generation weight is sharded along {mesh.axis_names[0]!r}")
        shards = [s.data for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(mesh, spec), shards)

    return jax.tree.map(leaf, tree)


def allgather(value: Any) -> list[Any]:
    """Every process's `value` (any picklable object), in process order; one host sync.

    With one process, `[value]` and no communication."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(pickle.dumps(value), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([data.size], np.int64))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    gathered = multihost_utils.process_allgather(padded)
    return [pickle.loads(gathered[i, : int(sizes[i, 0])].tobytes()) for i in range(len(sizes))]


def any_process(flag: bool) -> bool:
    """True when `flag` is true on any process (e.g. a stop request); one host sync."""
    return any(allgather(bool(flag)))
