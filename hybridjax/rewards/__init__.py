"""Rewards: rule-based reward functions keyed by `data_source`, verl's reward managers over
isolated workers (`manager`, `scoring`), reward servers and their client (`serve`, `remote`),
and reward-model scoring (`hybridjax.rewards.reward_model`)."""

from hybridjax.rewards.manager import (
    RewardConfig,
    RewardFunctionError,
    RewardManager,
    RewardResult,
    concat_results,
    decode_responses,
    place_scores,
)
from hybridjax.rewards.registry import (
    default_compute_score,
    load_custom_reward_function,
    register_reward,
    registered_data_sources,
)

__all__ = [
    "RewardConfig",
    "RewardFunctionError",
    "RewardManager",
    "RewardResult",
    "concat_results",
    "decode_responses",
    "default_compute_score",
    "load_custom_reward_function",
    "place_scores",
    "register_reward",
    "registered_data_sources",
]
