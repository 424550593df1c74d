"""What trainer benchmarks record: stage timestamps, the profiled step, stability figures (the
GPU check's own pieces: tests/experiments/test_gpu_check.py)."""

import gzip
import json

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.benchmarks.recording import (
    StageClock,
    collective_bytes,
    collective_time_s,
    profile_step,
    stability,
    trace_events,
)
from hybridjax.rl.pipeline import timed


def test_stability_figures_by_hand():
    s = stability([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (s["min_s"], s["median_s"], s["max_s"], s["steps"]) == (1.0, 3.0, 100.0, 5)
    assert s["p95_s"] == pytest.approx(4.0 + 0.8 * 96.0)  # rank 0.95·4 = 3.8 between 4 and 100
    assert s["mean_s"] == 22.0
    assert s["std_s"] == pytest.approx(np.sqrt(np.mean((np.array([1, 2, 3, 4, 100]) - 22) ** 2)))


def test_stage_clock_records_each_timed_block_in_order():
    timing = {}
    with StageClock() as clock:
        with timed(timing, "gen"):
            pass
        with timed(timing, "update_actor"):
            pass
        origin = clock.events[0][1]
        events = clock.take(origin)
    assert [e["stage"] for e in events] == ["gen", "update_actor"]
    assert events[0]["start_s"] == 0.0 and events[0]["end_s"] <= events[1]["start_s"]
    # CPU keeps no device statistics: the resident peak since the previous stage ended
    assert all(e["host_peak_rss_bytes"] > 0 for e in events)
    assert set(timing) == {"gen", "update_actor"} and clock.take(origin) == []
    with timed(timing, "after"):  # detached: nothing recorded
        pass
    assert clock.events == []


def test_collective_bytes_of_an_hlo_module_by_hand():
    hlo = """
  %all-reduce.2 = (f32[32]{0}, f32[32,32]{1,0}) all-reduce(%wrapped_reduce, %dot), channel_id=1
  %ags = (bf16[4,8]{1,0}, bf16[32,8]{1,0}) all-gather-start(bf16[4,8]{1,0} %c), dimensions={0}
  %agd = bf16[32,8]{1,0} all-gather-done(%ags)
  %ag = f32[16]{0} all-gather(f32[2]{0} %d), dimensions={0}
  %rs = f32[2,3]{1,0} reduce-scatter(f32[16,3]{1,0} %e), dimensions={0}
  %sum = f32[16]{0} add(f32[16]{0} %ag, f32[16]{0} %ag)
"""
    got = collective_bytes(hlo)
    assert got["all-reduce"] == (32 + 32 * 32) * 4  # both results of the tuple
    assert got["all-gather"] == 32 * 8 * 2 + 16 * 4  # an async start: its result only
    assert got["reduce-scatter"] == 2 * 3 * 4
    assert got["all-to-all"] == got["collective-permute"] == 0
    # a tuple of six or more results marks every fifth with a comment holding `=`
    six = ", ".join(["f32[4]{0}"] * 5) + ", /*index=5*/f32[8,2]{1,0}"
    line = f"  %all-reduce.88 = ({six}) all-reduce(%a, %b), channel_id=3, to_apply=%add"
    assert collective_bytes(line)["all-reduce"] == (5 * 4 + 8 * 2) * 4


def test_collective_time_of_trace_events_by_hand(tmp_path):
    span = lambda name, ts, dur: {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": 1}
    events = [
        span("step", 0.0, 1000.0),
        span("update_actor", 100.0, 400.0),
        span("reshard", 600.0, 100.0),
        span("all-reduce.3", 150.0, 200.0),  # device 0, in update_actor (and step)
        span("all-reduce.3", 160.0, 100.0),  # device 1
        span("end: all-reduce.3", 350.0, 0.1),  # the runtime's end marker: not an instruction
        span("all-gather-start.1", 610.0, 20.0),  # an async pair: both halves count
        span("all-gather-done.1", 640.0, 40.0),
        span("fusion.2", 620.0, 50.0),
        span("reduce-scatter", 800.0, 60.0),  # step only
        span("all-to-all", 1200.0, 80.0),  # outside every span: nowhere
        {"ph": "i", "name": "all-reduce", "ts": 200.0},  # an instant, no duration
        {"ph": "M", "name": "thread_name", "args": {"name": "python"}},
    ]
    got = collective_time_s(events, ["step", "update_actor", "reshard", "gen"], devices=2)
    assert set(got) == {"step", "update_actor", "reshard"}  # `gen` has no span
    us = 1e-6 / 2  # microseconds summed over 2 devices → seconds per device
    assert got["update_actor"] == pytest.approx(
        {"all-reduce": 300 * us, "all-gather": 0, "reduce-scatter": 0, "all-to-all": 0}
        | {"collective-permute": 0}
    )
    assert got["reshard"]["all-gather"] == pytest.approx(60 * us)
    assert sum(got["reshard"].values()) == pytest.approx(60 * us)
    step = {k: v for k, v in got["step"].items() if v}
    assert step == pytest.approx(
        {"all-reduce": 300 * us, "all-gather": 60 * us, "reduce-scatter": 60 * us}
    )
    # read back from a profile folder's perfetto_trace.json.gz
    folder = tmp_path / "plugins" / "profile" / "2026_01_01"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": events}, f)
    assert trace_events(tmp_path) == events
    with pytest.raises(FileNotFoundError, match="perfetto_trace.json.gz"):
        trace_events(tmp_path / "plugins" / "profile" / "none")


def test_profile_step_writes_trace_pstats_and_flame_graph(tmp_path):
    result = profile_step(lambda: float(jnp.arange(4.0).sum()), tmp_path)
    assert result == 6.0
    assert (tmp_path / "host_profile.pstats").stat().st_size > 0
    assert (tmp_path / "host_profile.svg").read_text().lstrip().startswith("<")
    assert any((tmp_path / "trace").rglob("*.xplane.pb"))
    assert any(e.get("ph") == "X" for e in trace_events(tmp_path / "trace"))  # as JSON too
