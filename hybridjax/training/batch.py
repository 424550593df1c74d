"""The RL batch: one immutable pytree with verl's field names, filled stage by stage.

Layout (verl's): `prompts` B×P left padded, `responses` B×R right padded, and the model input is
`input_ids = concat(prompts, responses)` B×(P+R) with `attention_mask` and `position_ids` over
it. Each row carries its prompt's `uid` (int32, verl's `uid`/`index`): the rows of
one prompt form a group whatever their number and order, so a stage may drop or reorder rows
and group statistics (segmented sums over uids) stay right. Every per-token field over the
response is B×R float32 and 0 outside `response_mask`.

A stage returns `batch.replace(field=...)`; a stage that reads a field no earlier stage filled
calls `batch.require("field")`, which raises with that field's name.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FILLED_BY = {
    "uid": "gen",
    "rollout_log_probs": "gen",
    "rollout_logit_threshold": "gen (top-k/top-p sampling)",
    "rollout_is_weights": "old_log_prob (algorithm.rollout_is)",
    "reward_baselines": "reward (greedy baseline)",
    "token_level_scores": "reward",
    "token_level_rewards": "reward / adv (KL in reward)",
    "old_log_probs": "old_log_prob",
    "ref_log_prob": "ref",
    "teacher_log_prob": "teacher",
    "teacher_topk_log_probs": "teacher (distillation.topk)",
    "teacher_topk_ids": "teacher (distillation.topk)",
    "values": "values",
    "advantages": "adv",
    "returns": "adv",
    "routed_experts": "old_log_prob (actor.router_replay.mode R2) or gen (R3)",
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RLBatch:
    """One step's batch of B = prompts × rollout.n responses (see the module docstring)."""

    prompts: jax.Array  # B×P int32
    responses: jax.Array  # B×R int32
    response_mask: jax.Array  # B×R float32 0/1
    attention_mask: jax.Array  # B×(P+R) int32 0/1
    position_ids: jax.Array  # B×(P+R) int32
    uid: jax.Array | None = None  # B int32: the row's prompt (its group)
    rollout_log_probs: jax.Array | None = None
    # B×R float32: each token's sampled support, logits / T ≥ it (−inf: whole vocabulary)
    rollout_logit_threshold: jax.Array | None = None
    rollout_is_weights: jax.Array | None = None  # B×R, π_old / π_rollout bounded
    reward_baselines: jax.Array | None = None  # B, score of a greedy response to the prompt
    token_level_scores: jax.Array | None = None
    token_level_rewards: jax.Array | None = None
    old_log_probs: jax.Array | None = None
    ref_log_prob: jax.Array | None = None
    teacher_log_prob: jax.Array | None = None  # B×R, the distillation teacher's log-probs
    teacher_topk_log_probs: jax.Array | None = None  # B×R×k float32, its top-k (descending)
    teacher_topk_ids: jax.Array | None = None  # B×R×k int32, their token ids
    values: jax.Array | None = None
    advantages: jax.Array | None = None
    returns: jax.Array | None = None
    # B×(P+R)×L×k int32: the experts each token used in each MoE layer (routing replay)
    routed_experts: jax.Array | None = None

    @property
    def input_ids(self) -> jax.Array:
        """B×(P+R) int32: prompt then response tokens."""
        return jnp.concatenate([self.prompts, self.responses], axis=1)

    @property
    def batch_size(self) -> int:
        return self.responses.shape[0]

    def replace(self, **fields) -> RLBatch:
        return dataclasses.replace(self, **fields)

    def require(self, *names: str) -> tuple[jax.Array, ...]:
        """The named fields; raises ValueError naming a missing one and the stage that fills it."""
        out = []
        for name in names:
            value = getattr(self, name)
            if value is None:
                raise ValueError(
                    f"RLBatch.{name} is not set: the {FILLED_BY.get(name, '?')!r} stage fills it "
                    "and has not run"
                )
            out.append(value)
        return tuple(out)


def make_batch(
    prompt_ids_BxP: jax.Array,
    prompt_mask_BxP: jax.Array,
    response_ids_BxR: jax.Array,
    response_mask_BxR: jax.Array,
    rollout_log_probs_BxR: jax.Array | None = None,
    uid_B: jax.Array | None = None,
    response_valid_BxR: jax.Array | None = None,
) -> RLBatch:
    """Assembles an RLBatch from left-padded prompts and right-padded responses (rows already
    repeated n times per prompt; `uid_B` int32 names each row's prompt). Position
    ids count valid tokens from 0 at the first one. `response_valid_BxR` (default:
    `response_mask_BxR`) marks the response tokens attended to: in multi-turn rollouts the tool
    responses too, which `response_mask` leaves out of losses."""
    valid = response_mask_BxR if response_valid_BxR is None else response_valid_BxR
    attention_mask = jnp.concatenate(
        [prompt_mask_BxP.astype(jnp.int32), valid.astype(jnp.int32)], axis=1
    )
    position_ids = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)
    return RLBatch(
        prompts=prompt_ids_BxP.astype(jnp.int32),
        responses=response_ids_BxR.astype(jnp.int32),
        response_mask=response_mask_BxR.astype(jnp.float32),
        attention_mask=attention_mask,
        position_ids=position_ids,
        uid=None if uid_B is None else uid_B.astype(jnp.int32),
        rollout_log_probs=rollout_log_probs_BxR,
    )
