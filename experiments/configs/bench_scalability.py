"""Benchmark: hybridjax RL step time against batch size, response length and device count.

    python -m experiments.benchmarks.run --config=experiments/configs/bench_scalability.py
GRPO on peer workload a (~3.4M parameters, rollout.n = 4). Each point runs in its own process;
devices are simulated CPU devices sharing this machine's cores (see the module docstring).
"""

from ml_collections import ConfigDict


def get_config():
    return ConfigDict(
        dict(
            benchmark="scalability",
            results_root="results",
            scalability=dict(
                workload="a",
                batches="2,4,8",  # prompts per step (× rollout.n responses)
                response_lengths="16,32,64",
                devices="1,2,4,8",
                base_batch=8,
                base_response_length=64,
                warmup=1,
                steps=2,
                timeout_s=1800,
            ),
        )
    )
