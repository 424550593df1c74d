"""Benchmark: step-time stability over 200 quick-start steps (seed 000's min/median/p95/max/std).

    python -m experiments.benchmarks.run --config=experiments/configs/bench_stability.py
The throughput benchmark on `configs/quickstart.py` (GRPO from the shipped warm start) for 1
warm-up + 200 timed steps; `summary.json` holds `stability` and `steps_per_hour`, `steps.jsonl`
every step's stage timestamps, and the last step is profiled.
"""

from ml_collections import ConfigDict


def get_config():
    throughput = dict(
        workload="",
        trainer_config="configs/quickstart.py",
        overrides="",
        warmup=1,
        steps=200,
        profile=True,
        devices=0,
    )
    return ConfigDict(dict(benchmark="throughput", results_root="results", throughput=throughput))
