"""The compile-time-against-depth benchmark at a minimal size: the shape of what it writes."""

import json

import pytest

from experiments.benchmarks import compile_depth


@pytest.mark.slow
def test_compile_depth_writes_a_row_per_depth_and_scan_setting(tmp_path):
    compile_depth.main(["--layers", "1,2", "--repeats", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "compile_depth.json").read_text())
    rows = {(r["layers"], r["scan_layers"]): r for r in result["rows"]}
    assert set(rows) == {(1, False), (1, True), (2, False), (2, True)}
    measures = ("update_actor_s", "decode_s", "dense_decode_s")
    assert all(r[m] > 0 for r in rows.values() for m in measures)
    first, last = rows[(1, True)], rows[(2, True)]
    ratio = result["ratios"]["update_actor_2/1_scan_True"]
    assert ratio == pytest.approx(last["update_actor_s"] / first["update_actor_s"])
