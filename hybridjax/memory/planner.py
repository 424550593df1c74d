"""Memory planner: will a config fit the devices, before anything is placed on them?

    python -m hybridjax.plan --config=configs/gsm8k_grpo.py --devices=8 --device_memory_gb=80 \
        --config.actor_rollout_ref.model.path=configs/models/qwen2.5-7b

Every device stage of the RL step (`reward` with a reward model, `old_log_prob`, `ref`,
`teacher`, `values`, `update_critic`, `update_actor`) is lowered and compiled for the run's
training mesh from abstract inputs (`jax.ShapeDtypeStruct`s carrying their shardings; no
weight is materialised): XLA's memory analysis gives each program's outputs and donated
(aliased) bytes. The states every stage leaves resident (parameters, optimizer states,
reference and reward models, the rollout's weights in the generation layout, the KV page
pool, the batch) are summed from their shard shapes. What a stage allocates while it runs is
counted from shapes (`hybridjax.memory.counts`: gathered weights, activations, logits,
gradients, the optimizer step of one loop iteration). The peak of a stage is

    resident states + stage outputs − donated bytes + counted live bytes   (bytes per device)

XLA's CPU scratch of each program (`temp_size_in_bytes`) is kept beside it as
`xla_cpu_scratch_bytes`, not added: the CPU compiler fuses less than the GPU one and keeps buffers a
GPU program does not (for the 7B update, 181 GB of CPU scratch, mostly copies of float32 logits and
of the gathered embedding, against 29.6 GB counted). `gen` adds the rollout's decode scratch
(analytic: the logits, and the jnp path's gathered K/V copy where it makes one). What
`fsdp_config.*_offload` names is counted only in the stages that use it
(`hybridjax.training.offload`: the actor in `old_log_prob`, `update_actor` and `reshard`, its
optimizer state in `update_actor`, the reference, teacher and critic in theirs). A generative reward
model (`reward_model.generative`) is planned as an engine of its own: its weights stay, its KV pool
(sized after the rollout's, as the trainer builds them) is on the devices only in `reward`, beside
its decode scratch, unless `generative.free_cache_engine` is off. The KV pool is sized as the engine
sizes it: `rollout.num_pages`, else `gpu_memory_utilization` × (capacity − what is resident when the
engine starts). With `rollout.free_cache_engine` (the default; sync rollouts) the engine sleeps
after `gen` (`hybridjax.training.residency`): no training stage holds the pool or the generation
weights, and `reshard` writes the one new copy; without it both stay through every stage and
`reshard` holds a second copy while the new one lands.

The CLI compiles for `--devices` simulated CPU devices in its own process, so it runs anywhere
(docs/memory-planner.md: its error on CPU); with `--target=a100|h100` it compiles for
compile-only GPUs instead and adds XLA:GPU's bytes of every stage, the engine's programs and
the re-layout included (`MemoryPlan.xla_gpu`; docs/gpu-planning.md).
`trainer.check_memory=True` runs the same plan, without compiling (`compile_stages=False`), on
the run's own devices in the up-front config check.

Modules: `resident` (the resident states, as abstract arrays, and their bytes), `stages` (the
stage programs and what each allocates), `report` (`MemoryPlan`, its table and advice); this one
puts them together (`plan_memory`) and keeps their names importable from here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
from ml_collections import ConfigDict

from hybridjax.memory.report import GB, MemoryPlan, StagePlan, advise, size
from hybridjax.memory.resident import (
    abstract_batch,
    abstract_model,
    abstract_train_state,
    device_bytes,
    on_devices,
    resident_states,
)
from hybridjax.memory.stages import (
    StageBook,
    plan_gen,
    plan_reshard,
    plan_reward,
    plan_training,
    stage_batches,
)
from hybridjax.platforms import platform_of

log = logging.getLogger(__name__)

__all__ = [  # re-exported: their names were this module's
    "GB",
    "MemoryPlan",
    "StagePlan",
    "abstract_batch",
    "abstract_model",
    "abstract_train_state",
    "advise",
    "device_bytes",
    "device_capacity",
    "memory_problems",
    "plan_memory",
    "size",
]


def plan_memory(
    cfg: ConfigDict,
    actor_config,
    devices: int | None = None,
    capacity_bytes: int | None = None,
    target: str = "gpu",
    compile_stages: bool = True,
    device_list: list[Any] | None = None,
) -> MemoryPlan:
    """Plans `cfg` on the first `devices` devices of this process (all by default).

    Args:
      cfg: a full trainer config (validated); its `auto` dtypes are resolved, in place, for
        `target` (`hybridjax.config.run.resolve_dtypes`: bfloat16 on GPU).
      actor_config: the actor's ModelConfig (`hybridjax.training.build.actor_model_config`), built
        from `cfg` with its dtypes resolved for `target`.
      devices: how many of `jax.devices()` the meshes span.
      capacity_bytes: memory of one device; None = the device's `bytes_limit`, else (CPU) the
        host's physical memory split over its local devices.
      target: the backend the run will use, "gpu" (KV pool from gpu_memory_utilization,
        Pallas decode) or "cpu" (pool of max_num_seqs full sequences, jnp decode).
      compile_stages: compile every device stage for XLA's outputs, donated bytes and CPU
        scratch (seconds to many minutes for large models); False: outputs from shapes (a
        forward pass returns the batch plus one B×R float32 field; an update donates its
        state) and no `xla_cpu_scratch`. On compile-only GPUs (`device_list`) also the
        engine's prefill/extend/decode and the re-layout, into `MemoryPlan.xla_gpu`.
      device_list: the devices to plan on instead of `jax.devices()` (compile-only GPUs from
        `memory.gpu_targets.compile_only_devices`).
    Returns:
      the MemoryPlan.
    Raises:
      ValueError: fewer devices than `devices` (use the CLI, which simulates them).
    """
    from hybridjax.config.run import resolve, resolve_dtypes

    resolve_dtypes(cfg, target)
    available = device_list or jax.devices()
    devices = devices or len(available)
    if devices > len(available):
        raise ValueError(
            f"plan for {devices} devices, but this process has {len(available)}; run "
            f"`python -m hybridjax.plan --devices={devices}` (simulated CPU devices)"
        )
    capacity = capacity_bytes or device_capacity(available[0], len(jax.local_devices()))
    # the run as the trainer resolves it (one step per epoch: the schedule does not size memory)
    run = resolve(cfg, actor_config, 1, available[:devices])
    states = resident_states(cfg, run, actor_config, capacity, target)
    on_device, idle = on_devices(cfg, states)
    on_gpu = compile_stages and platform_of(available[:devices]) == "gpu"  # compile-only GPUs
    book = StageBook(cfg, run, states, idle, compile_stages, on_gpu, target)
    response = states.rollout.response_length
    forward_batch, update_batch = stage_batches(cfg, run, actor_config, response)
    plan_gen(book, cfg, states, on_device, actor_config, target)
    plan_reward(book, cfg, states, forward_batch, target)
    plan_training(book, states, actor_config, forward_batch, update_batch)
    plan_reshard(book, states)

    pages, page = states.pages, states.page
    full = pages // max(states.rollout.pages_per_seq, 1)
    plans, xla_scratch, xla_gpu = tuple(book.plans), book.xla_scratch, book.xla_gpu
    plan = MemoryPlan(devices, capacity, plans, pages, page, full, (), xla_scratch, xla_gpu)
    return dataclasses.replace(plan, advice=tuple(advise(plan, cfg, run.meshes.train, devices)))


def device_capacity(device, local_devices: int) -> int:
    """Bytes one device may use: its `bytes_limit`, else (CPU) physical memory / local devices."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local_devices


def memory_problems(cfg: ConfigDict, n_devices: int, actor_config) -> list[str]:
    """`trainer.check_memory`: the plan on this process's devices, as config problems (empty
    when it fits). The plan itself is logged."""
    target = platform_of(jax.devices()[:n_devices])
    # counted from shapes, without compiling every stage a second time (the run compiles them)
    plan = plan_memory(cfg, actor_config, n_devices, target=target, compile_stages=False)
    log.info("memory plan:\n%s", plan.report())
    if plan.fits:
        return []
    w = plan.worst
    return [
        f"trainer.check_memory: {w.name} needs {size(w.peak)} per device of "
        f"{size(plan.capacity)}; " + "; ".join(plan.advice or ("see the plan above",))
    ]
