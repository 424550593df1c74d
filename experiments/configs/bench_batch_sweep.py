"""Benchmark: steps/hour against the rollout batch (measured, quick start on this CPU) and where
memory runs out (the same config planned on one device of 400 MB).

    python -m experiments.benchmarks.run --config=experiments/configs/bench_batch_sweep.py
Settings: `experiments/benchmarks/batch_sweep.py`.
"""

import json

from ml_collections import ConfigDict


def get_config():
    sweep = dict(
        trainer_config="configs/quickstart.py",
        plan_config="configs/quickstart.py",  # the measured config, planned on one device
        # the pool the CPU engine allocates (256 full sequences), not a share of the device
        plan_overrides=json.dumps({"actor_rollout_ref.rollout.num_pages": 768}),
        batches="16,64,256",  # measured (prompts per step; × rollout.n 8)
        plan_batches="16,64,256,1024,4096,16384",  # planned (multiples of the mini-batch)
        devices=1,
        device_memory_gb=0.4,  # a 400 MB device: where this config runs out of memory
        measure=True,
        warmup=1,
        steps=2,
        timeout_s=3600,
    )
    return ConfigDict(dict(benchmark="batch_sweep", results_root="results", batch_sweep=sweep))
