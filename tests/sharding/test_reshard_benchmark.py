"""The reshard benchmark end to end at a test size: rows, byte counts and the plot (no timings)."""

import pytest
from ml_collections import ConfigDict

from experiments.benchmarks import reshard


def test_numpy_copy_covers_every_byte_in_chunks(monkeypatch):
    monkeypatch.setattr(reshard, "COPY_CHUNK_BYTES", 4 * 1000)
    times = reshard.numpy_copy_seconds(4 * 2500, repeats=2)  # 2 full chunks + 500 values
    assert set(times) == {"median", "best"} and 0 <= times["best"] <= times["median"]


@pytest.mark.slow
def test_benchmark_rows_and_plot(tmp_path):
    cfg = ConfigDict(dict(sizes="tiny", layouts=",".join(reshard.LAYOUTS), repeats=1, dtype=""))
    summary = reshard.run(cfg, tmp_path)
    rows = {r["layout"]: r for r in summary["rows"]}
    assert set(rows) == set(reshard.LAYOUTS)
    params = rows["fsdp8->tp8"]["param_bytes"]
    assert params == 4 * (256 * 64 + 64 * 8 * 8 * 4 + 3 * 64 * 128 + 3 * 64)  # tied, no bias
    # tp8 splits every weight 8 ways (norms replicated on 8 devices); dp4 × tp2 keeps 4 copies.
    norms = 4 * 3 * 64
    assert rows["fsdp8->tp8"]["reshard_bytes"] == params - norms + 8 * norms
    assert rows["fsdp4xtp2->dp4xtp2"]["reshard_bytes"] == 4 * (params - norms) + 8 * norms
    for row in rows.values():
        assert row["ratio_to_copy_best"] > 0 and row["reshard_s_best"] > 0
    assert summary["goal_met_best"] is False  # no row of 100M or more: goal not shown
    reshard.plot(summary, tmp_path)
    assert (tmp_path / "reshard.png").stat().st_size > 0
