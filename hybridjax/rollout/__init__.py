"""hybridjax.rollout: the paged-attention rollout engine (continuous batching, shared prompt
pages, sampling with log-probs). See `engine` for the JetStream-style surface and `batching`
for the trainer's `generate`."""

from hybridjax.rollout.batching import RolloutOutput, generate
from hybridjax.rollout.config import RolloutConfig, SamplingParams
from hybridjax.rollout.engine import Engine
from hybridjax.rollout.pages import Request

__all__ = ["Engine", "Request", "RolloutConfig", "RolloutOutput", "SamplingParams", "generate"]
