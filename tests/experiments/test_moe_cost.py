"""The MoE-against-dense benchmark runs and reports what it claims (never its timings)."""

import pytest

from experiments.benchmarks import moe_cost

pytestmark = pytest.mark.slow


def test_moe_runs_expert_parallel_and_matches_dense_active_params():
    moe = moe_cost.measure("moe", repeats=1)
    dense_fields = moe_cost.MODELS["dense"][0]
    assert (
        moe["active_params"] - moe_cost.ModelConfig(**dense_fields).num_params()
        < 0.01 * (moe["active_params"])
    )
    for stage in ("update", "decode"):
        assert moe[stage]["seconds"] > 0
        assert moe[stage]["collective_bytes"]["all-gather"] > 0  # tokens gathered per expert
        assert moe[stage]["collective_bytes"]["reduce-scatter"] > 0  # outputs sent back
