"""Tiny CPU config: a random 2-layer Qwen2-shaped model, the shipped GSM8K BPE tokenizer, GSM8K.

Algorithm: PPO with a critic and GAE (γ = λ = 1), as `gsm8k_ppo.py`, at a size that runs on a
laptop CPU in seconds per step. It differs from textbook PPO as verl does: the reward is one
rule-based score on the last response token (no per-token reward model), no KL penalty, token-mean
loss aggregation over the whole mini-batch, dual-clip (c = 3). The model is random, so the
reward stays near 0: this config exercises the machinery, it does not learn GSM8K.

Needs the GSM8K parquet (once):
    python -m hybridjax.data.gsm8k --input tests/assets/gsm8k --output data/gsm8k
Switch to GRPO: --config.algorithm.adv_estimator=grpo --config.critic.enable=False
    --config.actor_rollout_ref.rollout.n=4
"""

import os

import hybridjax
from hybridjax.config.schema import base_config

TOKENIZER = os.path.join(os.path.dirname(hybridjax.__file__), "assets", "tokenizers", "gsm8k_bpe")


def get_config():
    c = base_config()
    c.data.train_files = "data/gsm8k/train.parquet"
    c.data.val_files = "data/gsm8k/test.parquet"
    c.data.tokenizer = TOKENIZER
    c.data.max_prompt_length = 256
    c.data.max_response_length = 32
    c.data.filter_overlong_prompts = True
    c.data.train_batch_size = 16
    c.data.val_max_samples = 32

    model = c.actor_rollout_ref.model
    model.override_config = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attention_bias=True,  # Qwen2 has q/k/v biases
        tie_word_embeddings=True,
    )

    actor = c.actor_rollout_ref.actor
    actor.ppo_mini_batch_size = 8
    actor.ppo_micro_batch_size_per_gpu = 1
    actor.optim.lr = 1e-4
    rollout = c.actor_rollout_ref.rollout
    rollout.prompt_length = 256
    rollout.response_length = 32
    rollout.max_num_seqs = 64
    rollout.log_prob_micro_batch_size_per_gpu = 2
    rollout.decode_steps_per_call = 32

    c.critic.enable = True
    c.critic.ppo_mini_batch_size = 8
    c.critic.ppo_micro_batch_size_per_gpu = 1
    c.critic.optim.lr = 1e-4
    c.algorithm.adv_estimator = "gae"

    c.trainer.experiment_name = "tiny"
    c.trainer.total_training_steps = 4
    c.trainer.save_freq = 2
    c.trainer.test_freq = 2
    c.trainer.logger = ("console", "jsonl")
    return c
