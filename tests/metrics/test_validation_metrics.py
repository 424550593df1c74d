"""Validation metrics at N samples: hand-computed values on a fixed batch, verl's exact
bootstrap (an independent loop port of verl's `bootstrap_metric` / `calc_maj_val`), names."""

from collections import defaultdict

import numpy as np
import pytest

from hybridjax.metrics.tracking import console_line
from hybridjax.metrics.validation import (
    majority_values,
    process_validation_metrics,
    subset_sizes,
    validation_metric_dict,
)

# Two prompts of one data source, N = 4 responses each.
UIDS = ["a"] * 4 + ["b"] * 4
SCORES = [1.0, 0.0, 0.0, 0.0] + [1.0, 1.0, 1.0, 1.0]
PREDS = ["5", "7", "7", "7"] + ["3", "3", "3", "3"]


def _verl_bootstrap(data, subset_size, reduce_fns, n_bootstrap=1000, seed=42):
    """verl/trainer/ppo/metric_utils.py `bootstrap_metric`, as written there (loops)."""
    np.random.seed(seed)
    data_np = np.array(data, dtype=object)
    idxs = np.random.choice(len(data_np), size=(n_bootstrap, subset_size), replace=True)
    out = []
    for fn in reduce_fns:
        vals = [fn(data_np[idxs[b]]) for b in range(n_bootstrap)]
        out.append((float(np.mean(vals)), float(np.std(vals))))
    return out


def _verl_maj(data):
    """verl's `calc_maj_val(data, vote_key="pred", val_key="val")`."""
    vote2vals = defaultdict(list)
    for d in data:
        vote2vals[d["pred"]].append(d["val"])
    vote2cnt = {k: len(v) for k, v in vote2vals.items()}
    return vote2vals[max(vote2cnt, key=vote2cnt.get)][0]


def test_hand_computed_values_on_a_fixed_batch():
    m = process_validation_metrics(["gsm"] * 8, UIDS, {"acc": SCORES}, PREDS)["gsm"]["acc"]
    # per prompt: a = 0.25, b = 1
    assert m["mean@4"] == pytest.approx((0.25 + 1) / 2)
    assert m["std@4"] == pytest.approx((np.sqrt(0.25 * 0.75) + 0) / 2)
    # best@n of a: 1 − P(index 0 never drawn) = 1 − (3/4)^n; b is always 1. The bootstrap
    # estimates it from 1000 subsets (standard error ≈ 0.016 for a, halved by the average).
    assert m["best@2/mean"] == pytest.approx((1 - 0.75**2 + 1) / 2, abs=0.025)
    assert m["best@4/mean"] == pytest.approx((1 - 0.75**4 + 1) / 2, abs=0.025)
    p = 1 - 0.75**4  # per-subset best of a is Bernoulli(p): its std is sqrt(p(1 − p))
    assert m["best@4/std"] == pytest.approx(np.sqrt(p * (1 - p)) / 2, abs=0.02)
    assert m["worst@4/mean"] == pytest.approx((0.0 + 1) / 2, abs=0.025)  # a: (1/4)^4 ≈ 0
    # maj@4 of a: "5" (scored 1) wins with 3 or 4 of 4 draws, or 2 of 4 drawn first:
    # (4·(1/4)^3·(3/4) + (1/4)^4 + 6·(1/4)^2·(3/4)^2 / 2) = 40/256
    assert m["maj@4/mean"] == pytest.approx((40 / 256 + 1) / 2, abs=0.025)


def test_bootstrap_equals_verl_exactly():
    m = process_validation_metrics(["gsm"] * 8, UIDS, {"acc": SCORES}, PREDS)["gsm"]["acc"]
    expected = defaultdict(list)
    for uid in ("a", "b"):
        rows = [i for i, u in enumerate(UIDS) if u == uid]
        vals = [SCORES[i] for i in rows]
        for n in (2, 4):
            (bm, bs), (wm, ws) = _verl_bootstrap(vals, n, [np.max, np.min])
            votes = [{"val": SCORES[i], "pred": PREDS[i]} for i in rows]
            [(mm, ms)] = _verl_bootstrap(votes, n, [_verl_maj])
            for key, value in (
                (f"best@{n}/mean", bm),
                (f"best@{n}/std", bs),
                (f"worst@{n}/mean", wm),
                (f"worst@{n}/std", ws),
                (f"maj@{n}/mean", mm),
                (f"maj@{n}/std", ms),
            ):
                expected[key].append(value)
    for key, values in expected.items():
        assert m[key] == pytest.approx(np.mean(values), abs=1e-12), key


def test_majority_ties_go_to_the_vote_seen_first():
    values, votes = np.array([1.0, 0.0, 0.0, 1.0]), ["x", "y", "y", "x"]
    idx = np.array([[0, 1, 2, 3], [1, 0, 3, 2], [2, 2, 0, 3], [3, 0, 1, 1]])
    # 2-2 tie (x first) → 1; 2-2 tie (y first) → 0; y×2 vs x×2, y first → 0; x wins 2-2 → 1
    np.testing.assert_array_equal(majority_values(values, votes, idx), [1.0, 0.0, 0.0, 1.0])
    # None (no answer) is a vote like any other, as in verl
    assert majority_values(np.array([0.0, 0.0, 1.0]), [None, None, "4"], idx[:1, :3]) == [0.0]


def test_names_core_and_aux():
    nested = process_validation_metrics(
        ["gsm"] * 8, UIDS, {"acc": SCORES, "format": [1.0] * 8}, PREDS
    )
    flat = validation_metric_dict(nested)
    core = sorted(k for k in flat if k.startswith("val-core/"))
    assert core == [
        "val-core/gsm/acc/best@4/mean",
        "val-core/gsm/acc/best@4/std",
        "val-core/gsm/acc/maj@4/mean",
        "val-core/gsm/acc/maj@4/std",
        "val-core/gsm/acc/mean@4",
    ]
    for key in ("acc/std@4", "acc/best@2/mean", "acc/worst@4/mean", "format/mean@4"):
        assert f"val-aux/gsm/{key}" in flat
    assert flat["val-aux/gsm/format/best@4/mean"] == 1.0
    # without votes there is no maj@; with one sample only mean@1; no `acc`: `reward` is core
    single = validation_metric_dict(
        process_validation_metrics(["s", "t"], [0, 1], {"reward": [1, 0]})
    )
    assert single == {"val-core/s/reward/mean@1": 1.0, "val-core/t/reward/mean@1": 0.0}
    assert subset_sizes(1) == [] and subset_sizes(8) == [2, 4, 8] and subset_sizes(5) == [2, 4, 5]
    line = console_line(1, flat)
    assert "gsm/acc/maj@4/mean" in line and "/std" not in line
