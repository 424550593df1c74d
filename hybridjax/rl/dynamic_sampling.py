"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, §3.2): the `filter_groups` stage.

After `reward`. A group (the responses sharing a uid) whose metric has no spread (every
response right, or every one wrong) gives GRPO no signal; the stage drops those groups and has
the step sample again (`gen`, `reward`, and any user stage between them: `resample`) on the
next batches of prompts until `data.train_batch_size` groups are kept, then keeps the first
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
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from ml_collections import ConfigDict

from hybridjax.rewards.manager import RewardResult
from hybridjax.rl.generation import HostColumns, put_global
from hybridjax.training.batch import RLBatch

METRICS = ("score", "acc", "seq_reward")  # always available; reward-function keys too


def metric_values(name: str, batch: RLBatch, result: RewardResult | None) -> np.ndarray:
    """(B,) float values of `algorithm.filter_groups.metric` for the rows of `batch`, scored
    with `result` (the rule reward's; None: a user's stage replaced the reward).

    Raises:
      ValueError: the reward function returned no such key (the message lists the valid ones).
    """
    extra = {} if result is None else result.extra
    if name in extra:
        return np.asarray(extra[name], np.float64)
    if name in ("score", "acc") and result is not None:
        return np.asarray(result.scores, np.float64)
    if name == "seq_reward":
        scores = jax.device_get(batch.token_level_scores * batch.response_mask)
        return np.asarray(scores, np.float64).sum(-1)
    raise ValueError(
        f"algorithm.filter_groups.metric {name!r} is not a value of the reward; valid: "
        f"{', '.join(sorted(set(METRICS) | set(extra)))}"
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


def filter_groups(
    batch: RLBatch,
    host: HostColumns,
    reward: RewardResult | None,
    spec: ConfigDict,
    wanted: int,
    sharding: NamedSharding,
    resample: Callable[[int], tuple[RLBatch, HostColumns, RewardResult | None]],
) -> tuple[RLBatch, HostColumns, dict[str, float]]:
    """DAPO's dynamic sampling (see the module docstring) of the scored generation batch
    `batch` (its host columns and reward result): keeps `wanted` groups, calling
    `resample(k)` for generation batch k = 1, 2, ... of the step (scored) while too few vary.
    `spec` is `algorithm.filter_groups`; the kept rows go to `sharding`.

    Returns:
      (the batch of `wanted` groups, its host columns, the `train/num_*` metrics).
    Raises:
      RuntimeError: `max_num_gen_batches` batches did not give `wanted` groups.
    """
    parts: list[tuple[RLBatch, HostColumns, np.ndarray]] = []
    kept, dropped, batches = 0, 0, 1
    while True:
        uid = np.asarray(jax.device_get(batch.uid))
        keep_B = varied_groups(metric_values(spec.metric, batch, reward), uid)
        kept += len(np.unique(uid[keep_B]))
        dropped += len(np.unique(uid[~keep_B]))
        parts.append((batch, host, keep_B))
        if kept >= wanted:
            break
        if 0 < spec.max_num_gen_batches <= batches:
            raise RuntimeError(
                f"algorithm.filter_groups: {batches} generation batches kept {kept} of "
                f"the {wanted} groups a step needs (algorithm.filter_groups.max_num_gen_batches "
                f"= {spec.max_num_gen_batches}): the prompts may be too hard or too easy for "
                "the model. Raise the cap, or set it to 0 for no cap."
            )
        batch, host, reward = resample(batches)  # fresh prompts, rows and scores
        batches += 1
    batch, host = _take(parts, wanted, sharding)
    metrics = {
        "train/num_gen_batches": float(batches),
        "train/num_kept_groups": float(kept),
        "train/num_dropped_groups": float(dropped),
    }
    return batch, host, metrics
