"""Benchmark: checkpoint save/restore of the trainer state, parquet vs Arrow IPC loading, the
reward service (rule function and reward model: in the trainer, in workers, on servers).

    python -m experiments.benchmarks.run --config=experiments/configs/bench_integration.py
Settings and what is measured: `experiments/benchmarks/integration.py`. The engine against HF
generate and the re-layout are `experiments/configs/bench_generation.py` and
`experiments/configs/bench_reshard.py`.
"""

from ml_collections import ConfigDict


def get_config():
    integration = dict(
        model="100M",  # experiments.benchmarks.generation.MODELS: tiny | 4M | 100M | 0.5B
        repeats=3,
        loading_copies=10,  # GSM8K train repeated: 74,730 rows
        reward_parts="rule,model",  # reward_service parts; "" = none
        reward_warmup=2,
        reward_steps=5,
    )
    return ConfigDict(
        dict(benchmark="integration", results_root="results", integration=integration)
    )
