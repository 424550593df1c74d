"""Validation: generate on the validation set with `rollout.val_kwargs`, score, and report
`val-core/<data_source>/acc/mean@<n>` (verl's name: the mean score of every sample, per data
source). Rows that only pad the last batch are left out."""

from __future__ import annotations

import collections

import numpy as np

from hybridjax.data.dataset import PromptLoader
from hybridjax.models.tokenizer import Tokenizer
from hybridjax.rewards import RewardManager
from hybridjax.rollout import Engine, SamplingParams
from hybridjax.trainer.generation import collect_rewards, generate_batch, submit_rewards


def validate(
    engine: Engine,
    loader: PromptLoader,
    sampling: SamplingParams,
    tokenizer: Tokenizer,
    rewards: RewardManager,
    sharding,
    first_index: int = 0,
) -> dict[str, float]:
    """Scores one pass over the validation loader. Host sync per batch (rollout, scoring).
    `first_index`: where this process's share of each batch starts (`jax.distributed`)."""
    scores: dict[str, list[float]] = collections.defaultdict(list)
    for prompts in loader.iter_epoch():
        _, host = generate_batch(
            engine, prompts, sampling, tokenizer.pad_token_id, sharding, first_index
        )
        result = collect_rewards(submit_rewards(rewards, tokenizer, host))
        for source, score, keep in zip(host.data_source, result.scores, host.row_mask, strict=True):
            if keep:
                scores[source].append(float(score))
    return {
        f"val-core/{source}/acc/mean@{sampling.n}": float(np.mean(values))
        for source, values in sorted(scores.items())
    }
