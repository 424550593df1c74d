"""Benchmark: throughput of the full hybridjax RL step (GRPO) on peer workload b.

    python -m experiments.benchmarks.run --config=experiments/configs/bench_throughput.py
    python -m experiments.benchmarks.run --config=experiments/configs/bench_throughput.py \
        --config.throughput.workload=a
Reports steps/hour, tokens/s, per-stage times, MFU of the actor update and of the whole step
against the peak matmul FLOP/s measured in the same run.
"""

from ml_collections import ConfigDict


def get_config():
    return ConfigDict(
        dict(
            benchmark="throughput",
            results_root="results",
            throughput=dict(
                workload="b",  # a | b | tiny; "" = trainer_config
                trainer_config="",  # a trainer config file, used when workload is ""
                overrides="",  # JSON: dotted trainer keys -> values
                warmup=1,
                steps=3,
                profile=True,  # last step under the JAX profiler and cProfile (flame graph)
                devices=0,  # simulated CPU devices; 0 = the platform's default
            ),
        )
    )
