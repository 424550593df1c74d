"""Validation metrics over N samples per prompt, with verl's names and semantics.

A port of verl's `process_validation_metrics` / `bootstrap_metric` / `calc_maj_val`
(verl/trainer/ppo/metric_utils.py) and of the naming in `RayPPOTrainer._val_metrics_update`.
For every data source, every numeric variable `var` (the score `acc`, and each numeric extra key
a reward function returns) and every prompt (uid) with N responses:

* `mean@N`: mean over the N responses; `std@N` (N > 1): their population standard deviation;
* for each n in 2, 4, 8, ... (< N) and N: 1,000 bootstrap subsets of n responses drawn with
  replacement; `best@n/mean` and `best@n/std` are the mean and standard deviation over the
  subsets of the subset's maximum, `worst@n/*` of its minimum; `maj@n/*` (only when the rows
  carry votes, verl's `pred`) of the value of the majority vote: the most frequent vote of the
  subset, ties going to the vote seen first in the subset, valued by its first response there.

Each per-prompt value is then averaged over the prompts of the data source. The subsets come
from `numpy.random.RandomState(seed).choice(N, (1000, n))` with seed 42 for every prompt,
every n and every variable, exactly as verl's re-seeded `np.random.choice`, so the numbers
equal verl's on the same scores (they are estimates of the expectation over subsets, with the
bootstrap's sampling error of about std / sqrt(1000)).

Names: `val-core/<data_source>/<core>/<metric>` for the core variable (`acc` if present, else
`reward`) and the metrics `mean@N`, `best@N/*`, `maj@N/*` at the largest N; everything else
(`std@N`, `worst@*`, smaller n, other variables) is `val-aux/<data_source>/<var>/<metric>`.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

N_BOOTSTRAP = 1000
SEED = 42


def subset_sizes(n_resps: int) -> list[int]:
    """verl's `gen_ns`: 2, 4, 8, ... below `n_resps`, then `n_resps`; [] when n_resps <= 1."""
    if n_resps <= 1:
        return []
    sizes, n = [], 2
    while n < n_resps:
        sizes.append(n)
        n *= 2
    return sizes + [n_resps]


@functools.lru_cache(maxsize=64)
def bootstrap_indices(n_data: int, subset_size: int, n_bootstrap: int, seed: int) -> np.ndarray:
    """(n_bootstrap, subset_size) int indices into n_data, drawn with replacement; the same draw
    as verl's `np.random.seed(seed); np.random.choice(n_data, size=..., replace=True)`."""
    idx = np.random.RandomState(seed).choice(n_data, size=(n_bootstrap, subset_size), replace=True)
    idx.flags.writeable = False
    return idx


def majority_values(values: np.ndarray, votes: Sequence[Hashable], idx: np.ndarray) -> np.ndarray:
    """verl's `calc_maj_val` on each bootstrap subset.

    Args:
      values: (N,) float64 values of one prompt's responses.
      votes: N hashable votes (extracted answers; None is a vote like any other, as in verl).
      idx: (S, n) indices of S subsets.
    Returns:
      (S,) the value of the first response, in subset order, holding the subset's most frequent
      vote (ties: the vote that appears first in the subset).
    """
    ids: dict[Hashable, int] = {}
    codes = np.array([ids.setdefault(v, len(ids)) for v in votes])
    picked = codes[idx]  # S×n
    counts = (picked[:, :, None] == picked[:, None, :]).sum(-1)  # S×n: votes equal to each
    first = counts.argmax(1)  # first position of the earliest-seen most frequent vote
    return values[idx[np.arange(len(idx)), first]]


def prompt_metrics(
    values: np.ndarray, votes: Sequence[Hashable] | None, seed: int = SEED
) -> dict[str, float]:
    """`mean@N`, `std@N`, `best@n/*`, `worst@n/*`, `maj@n/*` of one prompt's N values (float64)."""
    n_resps = len(values)
    metrics = {f"mean@{n_resps}": float(np.mean(values))}
    if n_resps == 1:
        return metrics
    metrics[f"std@{n_resps}"] = float(np.std(values))
    for n in subset_sizes(n_resps):
        idx = bootstrap_indices(n_resps, n, N_BOOTSTRAP, seed)
        subsets = values[idx]
        for name, reduced in (("best", subsets.max(1)), ("worst", subsets.min(1))):
            metrics[f"{name}@{n}/mean"] = float(np.mean(reduced))
            metrics[f"{name}@{n}/std"] = float(np.std(reduced))
        if votes is not None:
            maj = majority_values(values, votes, idx)
            metrics[f"maj@{n}/mean"] = float(np.mean(maj))
            metrics[f"maj@{n}/std"] = float(np.std(maj))
    return metrics


def process_validation_metrics(
    data_sources: Sequence[str],
    uids: Sequence[Hashable],
    variables: dict[str, Sequence[float]],
    votes: Sequence[Hashable] | None = None,
    seed: int = SEED,
) -> dict[str, dict[str, dict[str, float]]]:
    """verl's `process_validation_metrics`: {data_source: {variable: {metric: value}}}.

    Args:
      data_sources, uids: per response (R each); responses sharing a uid are one prompt's samples.
      variables: name -> R numbers (the score under `acc` or `reward`, and extra reward keys).
        A variable whose first value is a string is skipped, as in verl.
      votes: R extracted answers for `maj@n` (verl's `pred`), or None for no majority metrics.
      seed: bootstrap seed (verl's default 42).
    Returns:
      per data source and variable, the metrics of `prompt_metrics` averaged over prompts.
    """
    rows: dict[str, dict[Hashable, list[int]]] = collections.defaultdict(dict)
    for i, (source, uid) in enumerate(zip(data_sources, uids, strict=True)):
        rows[source].setdefault(uid, []).append(i)
    numeric = {
        k: np.asarray(v, np.float64)
        for k, v in variables.items()
        if len(v) and not isinstance(v[0], str)
    }
    out: dict[str, dict[str, dict[str, float]]] = {}
    for source, groups in rows.items():
        per_var: dict[str, dict[str, list[float]]] = {}
        for members in groups.values():
            group_votes = None if votes is None else [votes[i] for i in members]
            for name, values in numeric.items():
                for metric, value in prompt_metrics(values[members], group_votes, seed).items():
                    per_var.setdefault(name, {}).setdefault(metric, []).append(value)
        out[source] = {
            name: {metric: float(np.mean(vals)) for metric, vals in metrics.items()}
            for name, metrics in per_var.items()
        }
    return out


def _largest_n(metric_names: Any) -> int:
    return max(int(name.split("@")[-1].split("/")[0]) for name in metric_names)


def validation_metric_dict(
    nested: dict[str, dict[str, dict[str, float]]],
) -> dict[str, float]:
    """verl's `_val_metrics_update` naming: flat `val-core/...` and `val-aux/...` keys."""
    flat = {}
    for source, by_var in nested.items():
        core = "acc" if "acc" in by_var else "reward"
        for name, metrics in by_var.items():
            n_max = _largest_n(metrics)
            for metric, value in metrics.items():
                is_core = (
                    name == core
                    and metric.startswith(("mean", "maj", "best"))
                    and f"@{n_max}" in metric
                )
                section = "val-core" if is_core else "val-aux"
                flat[f"{section}/{source}/{name}/{metric}"] = value
    return flat
