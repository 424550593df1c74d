"""GRPO at 8B on 8 × 80 GB GPUs: Qwen3-8B, prompts ≤ 1,024 and responses ≤ 2,048 tokens.

    python -m hybridjax.train --config=configs/gpu_grpo_qwen3_8b.py \\
        --config.actor_rollout_ref.model.path=/path/to/Qwen3-8B

`configs/gpu_grpo_qwen2_7b.py` (verl's `run_qwen2-7b.sh`, whose batch, KL and rollout settings
verl's `run_qwen3-8b.sh` shares) with twice its prompt and response lengths: 1,024 prompts ×
5 responses, mini-batches of 256 prompts, k3 KL loss 0.001, gradient checkpointing,
`gpu_memory_utilization` 0.6, the reference's parameters on the host in bfloat16, FSDP over all
8 devices. Two keys differ:

* micro-batches of 32 responses per device in the updates and the log-prob passes (40 at
  512 + 1,024): a row is twice as long;
* the rollout is tensor-parallel 4 (`mesh.generate` data 2 × tensor 4, verl's
  `rollout.tensor_model_parallel_size=4`): at 2, a replica's KV pool holds 109 sequences of
  3,072 tokens, fewer than its `max_num_seqs` of 256 (the plan's `change:` line), and the
  sequences past that many would be preempted and recomputed as they grow; at 4 it holds 262.

Planned per device against the 72 GB budget (0.9 × 80 GB), counted / XLA:GPU's peak on
8 × A100 (JAX 0.10.2): gen 46.18 / 46.33 GB (of it the KV pool 29.68 GB), old_log_prob
18.35 / 17.22 GB, ref 20.40 / 21.32 GB, update_actor 38.84 / 35.76 GB, reshard 17.29 /
17.29 GB; docs/gpu-planning.md has both targets. The plan (Qwen3-8B's shapes):

    python -m hybridjax.plan --config=configs/gpu_grpo_qwen3_8b.py --devices=8 \\
        --target=a100 --config.actor_rollout_ref.model.path=configs/models/qwen3-8b
"""

import os

from hybridjax.user_code import load_module

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
    c = load_module(os.path.join(HERE, "gpu_grpo_qwen2_7b.py")).get_config()
    c.data.max_prompt_length = 1024
    c.data.max_response_length = 2048
    a = c.actor_rollout_ref
    a.rollout.prompt_length = 1024
    a.rollout.response_length = 2048
    a.actor.ppo_micro_batch_size_per_gpu = 32
    a.rollout.log_prob_micro_batch_size_per_gpu = 32
    a.ref.log_prob_micro_batch_size_per_gpu = 32
    c.mesh.generate = dict(data=2, tensor=4)  # rollout.tensor_model_parallel_size=4
    c.trainer.experiment_name = "qwen3_8b_grpo"
    c.trainer.default_local_dir = "checkpoints/hybridjax/qwen3_8b_grpo"
    return c
