"""Sampling-mask replay end to end: one GRPO step of the quick start sampling with top-p 0.8
and with top-k 20 (`experiments.benchmarks.mismatch.quickstart_ratios`). With the replayed
support the trainer's π_old equals the rollout's log-probs (IS ratio mean within 1e-3 of 1,
float32), in the step's own update and in a separate old_log_prob pass; scoring over the full
vocabulary the ratio is each token's kept probability mass instead."""

from __future__ import annotations

import pytest

from experiments.benchmarks.mismatch import SAMPLINGS, quickstart_ratios


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_replayed_support_makes_the_rollout_ratio_one(tmp_path, name):
    r = quickstart_ratios(tmp_path, SAMPLINGS[name])
    print(name, r)
    assert r[
        "auto_replays"
    ]  # float32  # rollout.log_prob_support "auto" replays a truncating rollout
    assert r["truncated_token_share"] > 0.5
    assert abs(r["is_ratio_mean_logged_by_the_step"] - 1.0) < 1e-3
    assert abs(r["is_ratio_mean_replay"] - 1.0) < 1e-3
    # full vocabulary: ρ_t = π_full / π_truncated = M_t, the kept mass (exp(full − replayed))
    assert r["kept_mass_max"] <= 1 + 1e-5 and 1 - r["kept_mass_mean"] > 1e-3
    assert r["is_ratio_mean_full_vocab"] == pytest.approx(r["kept_mass_mean"], abs=2e-4)
