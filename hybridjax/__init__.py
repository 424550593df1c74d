"""hybridjax: RL post-training for LLMs (PPO, GRPO and relatives) as one JAX/XLA program."""

__version__ = "0.1.0"
