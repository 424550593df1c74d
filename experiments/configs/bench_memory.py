"""Benchmark: the memory planner (`python -m hybridjax.plan`) against measured peaks on CPU.

    python -m experiments.benchmarks.run --config=experiments/configs/bench_memory.py
Settings and what is measured: `experiments/benchmarks/memory.py` (one CPU device per point).
"""

from ml_collections import ConfigDict


def get_config():
    memory = dict(
        models="256x4,512x4,512x8",  # <hidden>x<layers>, random Qwen2-shaped
        batch=8,  # prompts
        n=4,
        prompt_length=64,
        response_length=64,
        micro_batch=8,  # responses per micro-batch (log-prob and update passes)
        timeout_s=900,
    )
    return ConfigDict(dict(benchmark="memory", results_root="results", memory=memory))
