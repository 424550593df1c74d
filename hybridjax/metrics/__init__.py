"""Step metrics with verl's names, validation metrics at N samples, FLOP counting for MFU,
console/JSONL/TensorBoard/wandb sinks."""

from hybridjax.metrics.batch import compute_data_metrics
from hybridjax.metrics.flops import matmul_params, measure_peak_flops, training_flops
from hybridjax.metrics.perf import (
    compiled_programs,
    compute_perf_metrics,
    max_memory_allocated_gb,
    num_compiles,
)
from hybridjax.metrics.tracking import LOGGERS, Tracking, console_line

__all__ = [
    "LOGGERS",
    "Tracking",
    "compiled_programs",
    "compute_data_metrics",
    "compute_perf_metrics",
    "console_line",
    "matmul_params",
    "max_memory_allocated_gb",
    "measure_peak_flops",
    "num_compiles",
    "training_flops",
]
