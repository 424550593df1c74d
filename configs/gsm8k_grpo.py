"""GRPO on GSM8K with Qwen2.5-0.5B-Instruct: n = 5 responses per prompt, KL as a loss term.

    python -m hybridjax.train --config=configs/gsm8k_grpo.py \
        --config.actor_rollout_ref.model.path=/path/to/Qwen2.5-0.5B-Instruct

How it differs from textbook GRPO (Shao et al. 2024, DeepSeekMath), as verl's recipe does:
  * advantage = (score − group mean) / (group std + 1e-6) with the unbiased std, one outcome
    score per response, the same advantage on every token; no critic;
  * KL to the reference is a loss term (`use_kl_loss`, k3 `low_var_kl`, coefficient 0.001),
    not a reward penalty; the k3 log-ratio is clamped to ±20 and the value to [−10, 10];
  * token-mean loss over the mini-batch (the paper averages per sequence first:
    `actor.loss_agg_mode=seq-mean-token-mean` restores it); PPO clip 0.2 with dual clip c = 3;
  * one pass over the batch (`ppo_epochs` 1) in mini-batches of 64 prompts × 5 responses.

Data: `python -m hybridjax.data.gsm8k --input tests/assets/gsm8k --output data/gsm8k`.
"""

from hybridjax.config.schema import base_config


def get_config():
    c = base_config()
    c.data.train_files = "data/gsm8k/train.parquet"
    c.data.val_files = "data/gsm8k/test.parquet"
    c.data.train_batch_size = 256
    c.data.max_prompt_length = 512
    c.data.max_response_length = 512
    c.data.filter_overlong_prompts = True

    a = c.actor_rollout_ref
    a.model.path = ""  # set with --config.actor_rollout_ref.model.path=...
    a.model.enable_gradient_checkpointing = True
    a.actor.optim.lr = 1e-6
    a.actor.ppo_mini_batch_size = 64
    a.actor.ppo_micro_batch_size_per_gpu = 8
    a.actor.use_kl_loss = True
    a.actor.kl_loss_coef = 0.001
    a.actor.kl_loss_type = "low_var_kl"
    a.actor.entropy_coeff = 0.0
    a.rollout.n = 5
    a.rollout.prompt_length = 512
    a.rollout.response_length = 512
    a.rollout.log_prob_micro_batch_size_per_gpu = 16
    a.rollout.gpu_memory_utilization = 0.6
    a.ref.log_prob_micro_batch_size_per_gpu = 16

    c.critic.enable = False
    c.algorithm.adv_estimator = "grpo"
    c.algorithm.use_kl_in_reward = False

    c.trainer.experiment_name = "gsm8k_grpo"
    c.trainer.default_local_dir = "checkpoints/hybridjax/gsm8k_grpo"
    c.trainer.total_epochs = 15
    c.trainer.save_freq = 10
    c.trainer.test_freq = 10
    return c
