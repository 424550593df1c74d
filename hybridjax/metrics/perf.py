"""`perf/*` metrics of a step: tokens, throughput per device, actor MFU, peak memory, compiles."""

from __future__ import annotations

import resource
import sys
from typing import Any

import jax
import numpy as np

from hybridjax.metrics.flops import training_flops
from hybridjax.models.config import ModelConfig

# JAX reports the duration of every XLA backend compilation under this event name, with the
# program's name (`fun_name`, e.g. "jit(update_actor)").
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles: dict[str, Any] = {"names": [], "seconds": 0.0, "listening": False}


def _on_event_duration(event: str, duration_secs: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE_EVENT:
        _compiles["names"].append(str(kwargs.get("fun_name", "?")))
        _compiles["seconds"] += duration_secs


def num_compiles() -> tuple[int, float]:
    """(XLA compilations, their total seconds) in this process since the first call.

    Counts every backend compile of every jitted program (training stages, rollout prefill and
    decode buckets, re-layout, small utility programs), through `jax.monitoring`; a cache hit
    (same program, same shapes) is not a compile. A count that keeps growing after the first
    steps means shapes that change from step to step (a recompile per step); `compiled_programs`
    names them.
    """
    if not _compiles["listening"]:
        jax.monitoring.register_event_duration_secs_listener(_on_event_duration)
        _compiles["listening"] = True
    return len(_compiles["names"]), _compiles["seconds"]


def compiled_programs() -> list[str]:
    """The names of the programs `num_compiles` counted, in compile order (a copy; e.g.
    `jit(update_actor)`, `jit(<lambda>)` for an anonymous function). Starts counting as
    `num_compiles` does."""
    num_compiles()
    return list(_compiles["names"])


def max_memory_allocated_gb() -> float:
    """Peak device memory in use on device 0 (GB); on backends without memory statistics (CPU),
    the process's peak resident set size instead."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e9


def compute_perf_metrics(
    seq_lens: np.ndarray,
    timing_s: dict[str, float],
    n_devices: int,
    actor_config: ModelConfig,
    ppo_epochs: int,
    peak_flops: float,
) -> dict[str, float]:
    """Throughput and MFU of one step (verl's `compute_throughout_metrics` and `perf/mfu/actor`).

    Args:
      seq_lens: (B,) valid prompt + response tokens of each sequence of the step.
      timing_s: the step's stage times; reads `step` and `update_actor` (absent: MFU 0).
      n_devices: devices the step ran on.
      actor_config: the actor model (for the FLOP count).
      ppo_epochs: passes of the update over the batch.
      peak_flops: peak FLOP/s of one device.
    Returns:
      `perf/total_num_tokens`, `perf/time_per_step` (s), `perf/throughput` (tokens/s/device),
      `perf/mfu/actor` (achieved / peak FLOP/s over the update_actor stage, in [0, 1] ideally),
      `perf/max_memory_allocated_gb`, `perf/num_compiles` and `perf/compile_time_s` (XLA
      compilations in the process so far and their seconds, `num_compiles`).
    """
    tokens = float(np.sum(seq_lens))
    step_time = timing_s["step"]
    update_time = timing_s.get("update_actor", 0.0)
    flops = training_flops(actor_config, seq_lens) * ppo_epochs
    mfu = flops / (update_time * n_devices * peak_flops) if update_time > 0 and peak_flops else 0.0
    compiles, compile_s = num_compiles()
    return {
        "perf/total_num_tokens": tokens,
        "perf/time_per_step": step_time,
        "perf/throughput": tokens / (step_time * n_devices),
        "perf/mfu/actor": mfu,
        "perf/max_memory_allocated_gb": max_memory_allocated_gb(),
        "perf/num_compiles": float(compiles),
        "perf/compile_time_s": compile_s,
    }
