"""Routing replay's records (`rollout.enable_rollout_routing_replay`, a MoE model only): every
prefill, extend and decode call returns the experts each token it computes used in each MoE
layer, and each sequence keeps its share of every call as a chunk (`Scheduler.routing`), read
back in position order by `Engine.routing_of` (`sequence_experts`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# One call's share of a sequence's recorded experts (rollout routing replay): (N×T×L×k int32
# experts of the call's rows, on device or host; the row; its first `count` tokens).
Routing = tuple[Any, int, int]


def row_routing(
    record: bool,
    routed: Any,
    groups: Sequence[Sequence[Any]],
    n: int,
    rows: Sequence[Any],
    length: Callable[[Any], int],
) -> list[Routing | None]:
    """Each of `rows`' share (`Routing`) of a call's experts `routed` (rows of replica r's
    `groups[r]` at r·n + their index, `length(row)` tokens each), None without routing replay
    (`record` False) or tokens."""
    if not record:
        return [None] * len(rows)
    where = {id(x): r * n + i for r, g in enumerate(groups) for i, x in enumerate(g)}
    return [(routed, where[id(x)], length(x)) if length(x) else None for x in rows]


def sequence_experts(chunks: Sequence[Routing], shape: tuple[int, ...]) -> np.ndarray:
    """A sequence's recorded `chunks` joined in order: (fed positions)×L×k int32, with
    `shape` = (L, k) giving the layout when there is none. Host sync: waits for the calls
    that computed them."""
    parts = [np.asarray(a)[row, :count] for a, row, count in chunks]
    return np.concatenate(parts) if parts else np.zeros((0, *shape), np.int32)
