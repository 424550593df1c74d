"""verl's GSM8K GRPO recipe `examples/grpo_trainer/run_qwen2-7b.sh` on 8 × 80 GB GPUs.

    python -m hybridjax.train --config=configs/gpu_grpo_qwen2_7b.py \
        --config.actor_rollout_ref.model.path=/path/to/Qwen2-7B-Instruct

verl's settings, key for key: 1,024 prompts × 5 responses, prompts ≤ 512 and responses
≤ 1,024 tokens, mini-batches of 256 prompts, micro-batches of 40 responses per device, k3 KL
loss 0.001, gradient checkpointing, rollout tensor-parallel 2 at `gpu_memory_utilization`
0.6, the reference's parameters on the host (`ref.fsdp_config.param_offload`), in bfloat16
(`ref.fsdp_config.model_dtype`). verl's FSDP
mapping: parameters sharded over all 8 devices, bfloat16 compute and rollout.

The algorithm is `configs/gsm8k_grpo.py`'s (its docstring says how it differs from textbook
GRPO), at verl's 7B scale. Data: `python -m hybridjax.data.gsm8k --output data/gsm8k`.

Planned per device against the 72 GB budget (0.9 × 80 GB): gen 45.34 GB (of it the KV pool
26.06 GB; 56.61 GB with the jnp decode path's gathered K/V), old_log_prob 16.28 GB, ref
18.19 GB, update_actor 30.66 GB (109.7 GB before the fused head and the engine's sleep,
43.95 GB before the vocab-parallel head), reshard 20.94 GB (19.59 GB before the layers were
stored stacked: the re-layout's one-leaf scratch is a stacked MLP weight); docs/memory.md has the
table. The plan:

    python -m hybridjax.plan --config=configs/gpu_grpo_qwen2_7b.py --devices=8 \
        --device_memory_gb=80 --noxla \
        --config.actor_rollout_ref.model.path=configs/models/qwen2.5-7b-instruct
"""

from hybridjax.config.schema import base_config


def get_config():
    c = base_config()
    c.data.train_files = "data/gsm8k/train.parquet"
    c.data.val_files = "data/gsm8k/test.parquet"
    c.data.filter_overlong_prompts = True
    c.data.train_batch_size = 1024
    c.data.max_prompt_length = 512
    c.data.max_response_length = 1024

    a = c.actor_rollout_ref
    a.model.path = ""  # set with --config.actor_rollout_ref.model.path=...
    a.model.dtype = "bfloat16"
    a.model.enable_gradient_checkpointing = True
    a.actor.ppo_mini_batch_size = 256
    a.actor.ppo_micro_batch_size_per_gpu = 40
    a.actor.optim.lr = 1e-6
    a.actor.use_kl_loss = True
    a.actor.kl_loss_coef = 0.001
    a.actor.kl_loss_type = "low_var_kl"
    a.actor.entropy_coeff = 0.0
    a.actor.fsdp_config.param_offload = False
    a.actor.fsdp_config.optimizer_offload = False
    a.rollout.dtype = "bfloat16"
    a.rollout.n = 5
    a.rollout.prompt_length = 512
    a.rollout.response_length = 1024
    a.rollout.gpu_memory_utilization = 0.6
    a.rollout.log_prob_micro_batch_size_per_gpu = 40
    a.ref.log_prob_micro_batch_size_per_gpu = 40
    a.ref.fsdp_config.param_offload = True
    a.ref.fsdp_config.model_dtype = "bfloat16"  # frozen: half the bytes

    c.algorithm.adv_estimator = "grpo"
    c.algorithm.use_kl_in_reward = False
    c.mesh.train = dict(data=1, fsdp=8, tensor=1)  # verl's FSDP over every device
    c.mesh.generate = dict(data=4, tensor=2)  # rollout.tensor_model_parallel_size=2
    c.trainer.experiment_name = "qwen2_7b_grpo"
    c.trainer.default_local_dir = "checkpoints/hybridjax/qwen2_7b_grpo"
    c.trainer.total_epochs = 15
    return c
