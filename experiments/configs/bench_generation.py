"""Benchmark: rollout engine tokens/s against HF `generate` on the same weights.

    python -m experiments.benchmarks.run --config=experiments/configs/bench_generation.py
Settings and what is measured: `experiments/benchmarks/generation.py`.
"""

from ml_collections import ConfigDict

from experiments.benchmarks.generation import default_config


def get_config():
    return ConfigDict(
        dict(benchmark="generation", results_root="results", generation=default_config())
    )
