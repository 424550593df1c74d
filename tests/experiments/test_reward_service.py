"""The reward-stage benchmark's rule part end to end at one step (its shape, not its timings)."""

import pytest

from experiments.benchmarks import reward_service

pytestmark = pytest.mark.slow


def test_rule_part_times_every_placement():
    out = reward_service.rule_part(warmup=0, steps=1)
    placements = ("threads", "processes", "one_server", "two_servers")
    expected = {f"{kind}/{p}" for kind in ("cpu", "io") for p in placements}
    expected |= {"builtin_gsm8k/threads", "builtin_gsm8k/processes"}
    assert set(out) == expected
    for name, timing in out.items():
        assert len(timing["times_s"]) == 1 and timing["median_s"] > 0, name
    # 128 rows of 5 ms each take at least 128 · 5 ms / 16 workers, whatever the placement.
    assert all(out[f"io/{p}"]["median_s"] >= 0.04 for p in placements)
