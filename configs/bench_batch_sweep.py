"""Benchmark: steps/hour against the rollout batch (measured, quick start on this CPU) and where
memory runs out (planned, Qwen2.5-0.5B GRPO on 8 × 80 GB).

    python -m experiments.benchmarks.run --config=configs/bench_batch_sweep.py
Settings: `experiments/benchmarks/batch_sweep.py`.
"""

import json

from ml_collections import ConfigDict


def get_config():
    sweep = dict(
        trainer_config="configs/quickstart.py",
        plan_config="configs/gsm8k_grpo.py",
        plan_overrides=json.dumps(
            {"actor_rollout_ref.model.path": "configs/models/qwen2.5-0.5b-instruct"}
        ),
        batches="4,8,16,32",  # measured (prompts per step)
        plan_batches="256,512,1024,2048",  # planned
        devices=8,
        device_memory_gb=80.0,
        measure=True,
        warmup=1,
        steps=3,
        timeout_s=3600,
    )
    return ConfigDict(dict(benchmark="batch_sweep", results_root="results", batch_sweep=sweep))
