"""Benchmark: GRPO step time of TRL, Tunix and hybridjax on identical workloads (issue 9).

Needs the peers' virtualenvs once: `experiments/peers/setup_venvs.sh`. Then
    python -m experiments.benchmarks.run --config=experiments/configs/bench_peers.py
Workload qs: the quick-start model (3.4M) and task, 8 prompts × 4 samples, responses up to 16
tokens (overhead-bound). Workload c: the 3.4M random model, GSM8K prompts as they come, 8
prompts × 8 samples, responses up to 256 tokens ending at EOS (long ragged responses, prompts
shared by 8 samples). Workload b: ~102M parameters, 64-token prompts, 128-token responses
(compute-bound). Workload a (not in the default list): the 3.4M random model, GSM8K prompts,
responses up to 64 tokens.
"""

from ml_collections import ConfigDict


def get_config():
    return ConfigDict(
        dict(
            benchmark="peers",
            results_root="results",
            peers=dict(
                workloads="qs,c,b",
                systems="trl,tunix,hybridjax",
                rounds=2,
                steps=0,  # timed steps per run; 0 = the workload's default
                torch_threads=2,  # with OMP_WAIT_POLICY=PASSIVE
                xla_single_thread=False,  # True (with torch_threads=1): every system on 1 thread
                timeout_s=3600,
            ),
        )
    )
