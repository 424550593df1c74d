"""Benchmark: training reward and validation accuracy against steps for GRPO, PPO and RLOO.

    python -m experiments.benchmarks.run --config=experiments/configs/bench_algorithm.py
Runs on the quick-start task (`configs/quickstart.py`); each algorithm starts from the same
model, seed and data order. See `experiments/benchmarks/algorithm.py` for the keys each
algorithm changes.
"""

import os

from ml_collections import ConfigDict

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs")


def get_config():
    return ConfigDict(
        dict(
            benchmark="algorithm",
            results_root="results",
            algorithm=dict(
                trainer_config=os.path.join(CONFIGS, "quickstart.py"),
                workload="",  # a peer workload instead (e.g. "tiny"), when set
                algorithms="grpo,ppo,rloo",
                n=4,  # rollout.n for GRPO and RLOO (PPO uses 1)
                steps=20,
                test_freq=5,
                overrides="",  # JSON: dotted trainer keys -> values, for every algorithm
            ),
        )
    )
