"""verl's GSM8K PPO quick start (Qwen2.5-0.5B-Instruct, actor lr 1e-6, critic lr 1e-5).

    python -m hybridjax.train --config=configs/gsm8k_ppo.py \
        --config.actor_rollout_ref.model.path=/path/to/Qwen2.5-0.5B-Instruct

How it differs from textbook PPO (Schulman et al. 2017), as verl does:
  * one rule-based outcome reward on the last response token (GSM8K `#### <answer>` match),
    no learned reward model, no per-token reward; γ = λ = 1 GAE over response tokens only;
  * the critic is a copy of the actor's backbone with a fresh scalar head (verl's choice), and
    advantages are whitened over the valid tokens of the whole batch;
  * small KL-in-reward coefficient (0.001, fixed controller) available but off by default, as in
    verl's quick start; token-mean loss over the mini-batch; dual clip c = 3 for A < 0;
  * log-probs of the rollout are recomputed by the trainer (`old_log_probs`), not reused.

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
    a.actor.ppo_micro_batch_size_per_gpu = 4
    a.rollout.n = 1
    a.rollout.prompt_length = 512
    a.rollout.response_length = 512
    a.rollout.log_prob_micro_batch_size_per_gpu = 8
    a.rollout.gpu_memory_utilization = 0.4
    a.ref.log_prob_micro_batch_size_per_gpu = 4

    c.critic.enable = True
    c.critic.optim.lr = 1e-5
    c.critic.ppo_mini_batch_size = 64
    c.critic.ppo_micro_batch_size_per_gpu = 4

    c.algorithm.adv_estimator = "gae"
    c.algorithm.kl_ctrl.kl_coef = 0.001

    c.trainer.experiment_name = "gsm8k_ppo"
    c.trainer.total_epochs = 15
    c.trainer.save_freq = 10
    c.trainer.test_freq = 10
    return c
