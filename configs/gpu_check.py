"""GRPO on GSM8K with a random Qwen2.5-0.5B-shaped actor in bfloat16: the trainer config that
the GPU check's `grpo` step runs on one GPU (`experiments/gpu/grpo.py`).

The shape is Qwen2.5-0.5B-Instruct's (24 layers, width 896, 14 heads / 2 kv heads, vocabulary
151,936, tied embeddings); the weights are random and the tokenizer is the shipped GSM8K BPE
(its ids are a subset of the vocabulary), so nothing is downloaded and the reward stays near 0:
this measures speed and memory, not learning. 8 prompts × 5 samples, 256 + 512 tokens,
one on-policy update per step, matmuls in bfloat16 over float32 parameters, rollout weights and
KV pages in bfloat16, rematerialised layers.

Data: `python -m hybridjax.data.gsm8k --input tests/assets/gsm8k --output data/gsm8k` (the
check's `grpo` step does it when missing).
"""

import json
import os

import hybridjax
from hybridjax.config.schema import base_config

TOKENIZER = os.path.join(os.path.dirname(hybridjax.__file__), "assets", "tokenizers", "gsm8k_bpe")

MODEL = os.path.join(os.path.dirname(__file__), "models", "qwen2.5-0.5b-instruct", "config.json")
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


def get_config():
    c = base_config()
    c.data.train_files = "data/gsm8k/train.parquet"
    c.data.val_files = ""
    c.data.tokenizer = TOKENIZER
    c.data.max_prompt_length, c.data.max_response_length = 256, 512
    c.data.filter_overlong_prompts = True
    c.data.train_batch_size = 8

    a = c.actor_rollout_ref
    with open(MODEL) as f:
        hf = json.load(f)
    a.model.override_config = {k: hf[k] for k in SHAPE_KEYS} | {"attention_bias": True}
    a.model.dtype = "bfloat16"
    a.model.enable_gradient_checkpointing = True
    a.actor.ppo_mini_batch_size = 8
    a.actor.ppo_micro_batch_size_per_gpu = 8
    a.actor.optim.lr = 1e-6
    a.rollout.n = 5
    a.rollout.dtype = "bfloat16"
    a.rollout.prompt_length, a.rollout.response_length = 256, 512
    a.rollout.max_num_seqs = 40
    a.rollout.gpu_memory_utilization = 0.3
    a.rollout.log_prob_micro_batch_size_per_gpu = 20

    c.critic.enable = False
    c.algorithm.adv_estimator = "grpo"
    c.trainer.experiment_name = "gpu_check"
    c.trainer.default_local_dir = "checkpoints/hybridjax/gpu_check"
    c.trainer.total_training_steps = 3  # warm-up + 2 timed
    c.trainer.logger = ("console",)
    return c
