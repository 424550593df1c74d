"""The `reward` stage: rule-based scores in threads and/or a co-located reward model, and the
greedy-rollout baselines of estimators that ask for them (ReMax).

`submit` starts the work and returns at once (rule functions run in the reward manager's thread
pool, the reward-model forward is queued on the device), so the trainer can run the log-prob and
value passes meanwhile; `collect` waits for it. With `reward_model.enable` the model's score
replaces the rule's in `token_level_scores`, as verl's; the rule's result (and its metrics) is
still computed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from hybridjax.models.packing import PackingConfig
from hybridjax.models.tokenizer import Tokenizer
from hybridjax.rewards import RewardManager, RewardResult
from hybridjax.rewards.reward_model import score_responses
from hybridjax.trainer.batch import RLBatch
from hybridjax.trainer.build import forward_micro_batch
from hybridjax.trainer.generation import HostColumns, put_global, submit_rewards


@dataclasses.dataclass(frozen=True)
class PendingScores:
    """Scores of one batch being computed: the rule's future and the reward model's B×R token
    scores (queued on the device; None without a reward model)."""

    rule: concurrent.futures.Future[RewardResult]
    model: jax.Array | None


class RewardStage:
    """Scores responses for the `reward` stage.

    Args:
      manager: the rule-based reward manager (`reward_model.on_error`, custom functions, ...).
      tokenizer: decodes responses for the rule functions.
      reward_model: (graphdef, params) of a `SequenceClassifier` or None.
      micro_batch_size_per_device: `reward_model.micro_batch_size_per_gpu`.
      sharding: where per-row arrays go (the training mesh's batch axes).
      data_parallel: batch shards of the training mesh (data × fsdp).
      packing: the reward model's packed forward (`trainer.packing`), or None (padded).
    """

    def __init__(
        self,
        manager: RewardManager,
        tokenizer: Tokenizer,
        reward_model: tuple[Any, Any] | None,
        micro_batch_size_per_device: int,
        sharding: NamedSharding,
        data_parallel: int,
        packing: PackingConfig | None = None,
    ):
        self.manager = manager
        self.tokenizer = tokenizer
        self.reward_model = reward_model
        self.micro_per_device = micro_batch_size_per_device
        self.sharding = sharding
        self.data_parallel = data_parallel
        self.packing = packing

    def submit(self, batch: RLBatch, host: HostColumns) -> PendingScores:
        """Starts scoring `batch` (returns at once; no host sync)."""
        rule = submit_rewards(self.manager, self.tokenizer, host)
        model = None
        if self.reward_model is not None:
            graphdef, params = self.reward_model
            model, _ = score_responses(
                graphdef,
                params,
                batch.prompts,
                batch.attention_mask[:, : batch.prompts.shape[1]],
                batch.responses,
                batch.response_mask,
                micro_batch_size=forward_micro_batch(
                    self.micro_per_device, batch.batch_size, self.data_parallel
                ),
                packing=self.packing,
            )
        return PendingScores(rule, model)

    def collect(self, pending: PendingScores) -> tuple[jax.Array, RewardResult]:
        """(token_level_scores B×R float32 in `sharding`, the rule's result). Waits for both."""
        result = pending.rule.result()
        if pending.model is not None:
            return jax.block_until_ready(pending.model), result
        return put_global(result.token_level_scores, self.sharding), result

    def baselines(self, pending: PendingScores, n: int) -> jax.Array:
        """ReMax's `reward_baselines` (B·n,) float32: the score of each prompt's greedy response
        (`pending` scores B greedy responses), repeated for the prompt's n samples."""
        token_scores, _ = self.collect(pending)
        scores_B = jnp.sum(token_scores, axis=-1)
        return jax.device_put(jnp.repeat(scores_B, n), self.sharding)

    def close(self) -> None:
        self.manager.close()
