"""Benchmark: re-layout of actor weights TRAIN → GENERATION (the hybrid engine's weight move).

    python -m experiments.benchmarks.run --config=experiments/configs/bench_reshard.py
Settings and what is measured: `experiments/benchmarks/reshard.py` (8 simulated devices).
"""

from ml_collections import ConfigDict

from experiments.benchmarks.reshard import default_config


def get_config():
    return ConfigDict(dict(benchmark="reshard", results_root="results", reshard=default_config()))
