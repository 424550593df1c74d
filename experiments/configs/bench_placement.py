"""Benchmark: `sync` co-located against `one_step_off` with rollout and training on separate
pools (4 + 4 simulated CPU devices by default), on the quick-start workload.

    python -m experiments.benchmarks.run --config=experiments/configs/bench_placement.py
    python -m experiments.benchmarks.run --config=experiments/configs/bench_placement.py \
        --config.placement.devices=0 --config.placement.rollout_devices=4   # a GPU machine
Reports steps/hour, tokens/s, stage times, staleness and a timeline plot of both modes.
"""

import os

from ml_collections import ConfigDict

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs")


def get_config():
    return ConfigDict(
        dict(
            benchmark="placement",
            results_root="results",
            placement=dict(
                workload="",  # a peer workload ("b": 102M) instead of trainer_config
                trainer_config=os.path.join(CONFIGS, "quickstart.py"),
                # JSON: dotted trainer keys -> values; the quick start's micro-batches are sized
                # for one device: 16 per device fits 8 devices and the 4 of the training pool
                overrides=(
                    '{"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 16, '
                    '"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 16}'
                ),
                modes="",  # comma-separated subset of sync,sync_split,one_step_off; "": all
                rollout_devices=4,
                warmup=1,
                steps=4,
                devices=8,  # simulated CPU devices; 0 = the platform's default
            ),
        )
    )
