"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, §3.2) as the `filter_groups` stage.

Placed after `reward`. A group (the responses sharing a uid) whose metric has no spread (every
response right, or every one wrong) gives GRPO no signal; the stage drops those groups and runs
the stages before it (`gen`, `reward`, and any user stage there) again on the next batches of
prompts until `data.train_batch_size` groups are kept, then keeps the first
`data.train_batch_size` of them, so the later stages see the usual static shape. Keys, as
verl's `algorithm.filter_groups`:

* `enable`: add the stage.
* `metric`: the per-response value whose spread decides: `score` (the rule reward), `acc` (the
  reward function's `acc` if it returns one, else its score), `seq_reward` (the sum of
  `token_level_scores`: the reward model's score when one is used), or any other key the reward
  function returns in its dict.
* `max_num_gen_batches`: stop with an error after this many generation batches in one step
  (0 = no cap), as verl does.

A singleton group (rollout.n = 1) is always kept (verl). Metrics: `train/num_gen_batches`,
`train/num_kept_groups` and `train/num_dropped_groups` (over every generation batch of the step,
so kept + dropped = batches × data.train_batch_size). The `reward/*` metrics are the last
generation batch's. Host sync: the scores and the batch go to the host to select rows.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from hybridjax.rl.generation import HostColumns, put_global
from hybridjax.rl.pipeline import Stage, StepContext
from hybridjax.training.batch import RLBatch

METRICS = ("score", "acc", "seq_reward")  # always available; reward-function keys too


def metric_values(name: str, batch: RLBatch, ctx: StepContext) -> np.ndarray:
    """(B,) float values of `algorithm.filter_groups.metric` for the rows of `batch`.

    Raises:
      ValueError: the reward function returned no such key (the message lists the valid ones).
    """
    result = ctx.reward
    if name in result.extra:
        return np.asarray(result.extra[name], np.float64)
    if name in ("score", "acc"):
        return np.asarray(result.scores, np.float64)
    if name == "seq_reward":
        scores = jax.device_get(batch.token_level_scores * batch.response_mask)
        return np.asarray(scores, np.float64).sum(-1)
    raise ValueError(
        f"algorithm.filter_groups.metric {name!r} is not a value of the reward; valid: "
        f"{', '.join(sorted(set(METRICS) | set(result.extra)))}"
    )


def varied_groups(values_B: np.ndarray, uid_B: np.ndarray) -> np.ndarray:
    """Bool (B,): the row's group has a spread (max > min) or is a single row (verl's rule)."""
    uids, inverse, sizes = np.unique(uid_B, return_inverse=True, return_counts=True)
    high = np.full(len(uids), -np.inf)
    low = np.full(len(uids), np.inf)
    np.maximum.at(high, inverse, values_B)
    np.minimum.at(low, inverse, values_B)
    return ((high > low) | (sizes == 1))[inverse]


def _take(parts: list[tuple[RLBatch, HostColumns, np.ndarray]], groups: int, sharding):
    """(batch, host columns) of the first `groups` kept groups over the generation batches
    `parts` = [(batch, host, keep_B)], uids renumbered 0..groups−1 in order of appearance, the
    batch placed as `sharding`."""
    batches = [jax.device_get(b) for b, _, _ in parts]
    keep_rows = np.nonzero(np.concatenate([k for _, _, k in parts]))[0]
    keys = np.concatenate([i * len(b.uid) + np.asarray(b.uid) for i, b in enumerate(batches)])
    _, first, inverse = np.unique(keys[keep_rows], return_index=True, return_inverse=True)
    rank = np.empty(len(first), np.int64)
    rank[np.argsort(first)] = np.arange(len(first))  # groups in order of appearance
    group = rank[inverse]
    rows, group = keep_rows[group < groups], group[group < groups]

    def join(*leaves):
        if leaves[0] is None:
            return None
        return put_global(np.concatenate([np.asarray(x) for x in leaves])[rows], sharding)

    batch = jax.tree.map(join, *batches, is_leaf=lambda x: x is None)
    batch = batch.replace(uid=put_global(group.astype(np.int32), sharding))
    columns = {}  # `mine` (rows this process scores) stays "all": scoring is done
    for field in dataclasses.fields(HostColumns):
        if field.name == "mine":
            continue
        values = [getattr(h, field.name) for _, h, _ in parts]
        if isinstance(values[0], np.ndarray):
            columns[field.name] = np.concatenate(values)[rows]
        else:
            flat = [v for column in values for v in column]
            columns[field.name] = [flat[i] for i in rows]
    return batch, HostColumns(**columns)


def filter_groups(batch: RLBatch, ctx: StepContext) -> RLBatch:
    """DAPO's dynamic sampling (see the module docstring).

    Raises:
      RuntimeError: `max_num_gen_batches` batches did not give `data.train_batch_size` groups.
    """
    spec, wanted = ctx.config.algorithm.filter_groups, ctx.config.data.train_batch_size
    regenerate = ctx.pipeline.before(NAME)  # gen, reward and any stage between them
    parts, kept, dropped = [], 0, 0
    while True:
        uid = np.asarray(jax.device_get(batch.uid))
        keep_B = varied_groups(metric_values(spec.metric, batch, ctx), uid)
        kept += len(np.unique(uid[keep_B]))
        dropped += len(np.unique(uid[~keep_B]))
        parts.append((batch, ctx.host, keep_B))
        if kept >= wanted:
            break
        if 0 < spec.max_num_gen_batches <= ctx.gen_batches:
            raise RuntimeError(
                f"algorithm.filter_groups: {ctx.gen_batches} generation batches kept {kept} of "
                f"the {wanted} groups a step needs (algorithm.filter_groups.max_num_gen_batches "
                f"= {spec.max_num_gen_batches}): the prompts may be too hard or too easy for "
                "the model. Raise the cap, or set it to 0 for no cap."
            )
        # the same timers, metrics and models; fresh prompts, rows and scores
        more = dataclasses.replace(ctx, prompts=next(ctx.deps.train_loader), host=None)
        batch = regenerate.run(more)
        ctx.host, ctx.greedy, ctx.reward, ctx.gen_batches, ctx.models = (
            more.host,
            more.greedy,
            more.reward,
            more.gen_batches,
            more.models,  # as the regenerated stages left them
        )
    batch, ctx.host = _take(parts, wanted, ctx.deps.run.batch_sharding)
    ctx.metrics |= {
        "train/num_gen_batches": float(ctx.gen_batches),
        "train/num_kept_groups": float(kept),
        "train/num_dropped_groups": float(dropped),
    }
    return batch


NAME = "filter_groups"
FILTER_GROUPS = Stage(
    NAME,
    filter_groups,
    reads=("uid", "token_level_scores", "response_mask"),
    writes=("uid",),
)
