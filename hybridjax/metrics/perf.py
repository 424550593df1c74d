"""`perf/*` metrics of a step: tokens, throughput per device, actor MFU, peak memory."""

from __future__ import annotations

import resource
import sys

import jax
import numpy as np

from hybridjax.metrics.flops import training_flops
from hybridjax.models.config import ModelConfig


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
      `perf/max_memory_allocated_gb`.
    """
    tokens = float(np.sum(seq_lens))
    step_time = timing_s["step"]
    update_time = timing_s.get("update_actor", 0.0)
    flops = training_flops(actor_config, seq_lens) * ppo_epochs
    mfu = flops / (update_time * n_devices * peak_flops) if update_time > 0 and peak_flops else 0.0
    return {
        "perf/total_num_tokens": tokens,
        "perf/time_per_step": step_time,
        "perf/throughput": tokens / (step_time * n_devices),
        "perf/mfu/actor": mfu,
        "perf/max_memory_allocated_gb": max_memory_allocated_gb(),
    }
