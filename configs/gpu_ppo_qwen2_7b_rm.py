"""The seed workload: Qwen2-7B PPO with a critic and a 7B reward model on 8 × 80 GB GPUs.

    python -m hybridjax.train --config=configs/gpu_ppo_qwen2_7b_rm.py \
        --config.actor_rollout_ref.model.path=/path/to/Qwen2-7B-Instruct \
        --config.reward_model.model.path=/path/to/a-7B-reward-model

verl's settings of the seed run: 8 prompts per device in the rollout (64 in all), one
response each, prompts ≤ 512 and responses ≤ 1,024 tokens, 4 responses per device per
training micro-batch, the reward model scoring 16 rows per device, rollout tensor-parallel 2
at `gpu_memory_utilization` 0.5; verl's FSDP mapping: parameters sharded over all 8 devices,
bfloat16 compute and rollout, gradient checkpointing; the reward model frozen in bfloat16; the
actor's optimizer state, the whole critic and the reward model in host memory except in
the stages that use them. The critic starts from the actor's checkpoint with a fresh value
head (verl's PPO); GAE with γ = λ = 1.

Planned per device against the 72 GB budget (0.9 × 80 GB): gen 28.14 GB, reward 9.26 GB,
values 12.55 GB, update_critic 31.67 GB, update_actor 24.81 GB (80.9 GB before, 37.19 GB
before offloaded states stayed in host memory outside the stages that use them), reshard
11.97 GB; docs/memory.md has the table. The plan:

    python -m hybridjax.plan --config=configs/gpu_ppo_qwen2_7b_rm.py --devices=8 \\
        --device_memory_gb=80 --noxla \\
        --config.actor_rollout_ref.model.path=configs/models/qwen2.5-7b-instruct \\
        --config.reward_model.model.path=configs/models/qwen2.5-7b-instruct
"""

from hybridjax.config.schema import base_config


def get_config():
    c = base_config()
    c.data.train_batch_size = 64
    c.data.max_prompt_length = 512
    c.data.max_response_length = 1024
    c.data.filter_overlong_prompts = True

    a = c.actor_rollout_ref
    a.model.path = ""  # set with --config.actor_rollout_ref.model.path=...
    a.model.dtype = "bfloat16"
    a.model.enable_gradient_checkpointing = True
    a.actor.optim.lr = 1e-6
    a.actor.ppo_mini_batch_size = 64
    a.actor.ppo_micro_batch_size_per_gpu = 4
    a.actor.fsdp_config.optimizer_offload = True  # AdamW's moments on the host during gen
    a.rollout.dtype = "bfloat16"
    a.rollout.n = 1
    a.rollout.prompt_length = 512
    a.rollout.response_length = 1024
    a.rollout.gpu_memory_utilization = 0.5
    a.rollout.log_prob_micro_batch_size_per_gpu = 8

    c.critic.enable = True
    c.critic.model.path = ""  # "" = the actor's checkpoint
    c.critic.optim.lr = 1e-5
    c.critic.ppo_mini_batch_size = 64
    c.critic.ppo_micro_batch_size_per_gpu = 4
    c.critic.model.fsdp_config.param_offload = True  # the critic on the host during gen
    c.critic.model.fsdp_config.optimizer_offload = True

    c.reward_model.enable = True
    c.reward_model.model.path = ""  # set with --config.reward_model.model.path=...
    c.reward_model.micro_batch_size_per_gpu = 16
    c.reward_model.model.dtype = "bfloat16"  # frozen: half the bytes (the seed's RM is FP16)
    c.reward_model.model.fsdp_config.param_offload = True  # on the devices only to score (verl's)

    c.algorithm.adv_estimator = "gae"
    c.algorithm.gamma = 1.0
    c.algorithm.lam = 1.0
    c.mesh.train = dict(data=1, fsdp=8, tensor=1)  # verl's FSDP over every device
    c.mesh.generate = dict(data=4, tensor=2)  # rollout.tensor_model_parallel_size=2
    c.trainer.experiment_name = "qwen2_7b_ppo_rm"
    c.trainer.default_local_dir = "checkpoints/hybridjax/qwen2_7b_ppo_rm"
    return c
