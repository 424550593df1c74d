"""Benchmark suite: hand-checked helpers (fast) and every benchmark at a minimal size (slow).

The smoke tests run each benchmark end to end on the test-sized peer workload `tiny` and check
the shape of what it writes, never its timings. The TRL and Tunix runs are left out: they need
the peers' own virtualenvs (`experiments/peers/setup_venvs.sh`).
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest
from ml_collections import ConfigDict

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments" / "peers"))

from reward import StepClock, gsm8k_score  # noqa: E402

from experiments.benchmarks import algorithm, peers, run, scalability, throughput  # noqa: E402
from hybridjax.models.config import ModelConfig  # noqa: E402

# ---------------------------------------------------------------------------------- fast


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("#### 1,234", "1234", 1.0),
        ("First #### 3 then #### 4", "4", 1.0),
        ("#### -7", "-7", 1.0),
        ("The answer is 42", "42", 0.0),
        ("#### 5", "6", 0.0),
        ("####", "1", 0.0),
    ],
)
def test_gsm8k_score_matches_the_reference_cases(response, truth, score):
    assert gsm8k_score(response, truth) == score


def test_step_clock_times_gaps_between_reward_calls_and_counts_tokens():
    clock = StepClock({"q1": "4", "q2": "5"}, lambda prompts, completions: 10 * len(prompts))
    assert clock(["q1", "q2"], ["#### 4", "#### 4"]) == [1.0, 0.0]
    assert clock(["q2"], ["#### 5"]) == [1.0]
    assert clock.tokens == [20, 10]
    assert clock.scores == [0.5, 1.0]
    (gap,) = clock.step_times_s()
    assert gap == clock.stamps[1] - clock.stamps[0] and gap >= 0
    assert len(clock.step_cpu_times_s()) == 1
    with pytest.raises(KeyError, match="not in the workload"):
        clock(["q3"], ["x"])


def _run(times, tokens, warmup=1, cpu=None):
    return {
        "warmup": warmup,
        "step_times_s": times,
        "step_cpu_times_s": cpu or times,
        "tokens_per_step": tokens,
    }


def test_summarize_takes_medians_after_warm_up_over_all_runs():
    s = peers.summarize([_run([9.0, 2.0, 4.0], [1, 100, 100]), _run([9.0, 3.0], [1, 100])])
    assert s["step_time_s"] == 3.0  # median of 2, 4, 3
    assert s["step_time_mean_s"] == 3.0
    assert s["tokens_per_step"] == 100
    assert s["tokens_per_s"] == pytest.approx(100 / 3)
    assert s["steps_per_hour"] == pytest.approx(1200.0)
    assert s["timed_steps"] == 3


def test_ratio_is_against_the_faster_peer():
    table = {
        "trl": {"tokens_per_s": 100.0, "tokens_per_cpu_s": 50.0},
        "tunix": {"tokens_per_s": 80.0, "tokens_per_cpu_s": 60.0},
        "hybridjax": {"tokens_per_s": 300.0, "tokens_per_cpu_s": 120.0},
    }
    peers.add_ratios(table)
    assert table["hybridjax"]["ratio_vs_faster_peer"] == pytest.approx(3.0)
    assert table["hybridjax"]["cpu_ratio_vs_faster_peer"] == pytest.approx(2.0)


def test_markdown_table_has_a_row_per_system_and_the_ratio_on_hybridjax_only():
    row = {"step_time_s": 2.0, "step_cpu_time_s": 3.0, "tokens_per_step": 100, "tokens_per_s": 50}
    fast = row | {"ratio_vs_faster_peer": 3.0, "cpu_ratio_vs_faster_peer": 1.5}
    summary = {
        "workloads": {"a": {"num_params": 3.4e6, "systems": {"trl": row, "hybridjax": fast}}}
    }
    lines = peers.markdown_table(summary).splitlines()
    assert len(lines) == 4
    assert lines[2] == "| a (3.4M) | trl | 2.00 | 3.00 | 100 | 50 |  |"
    assert lines[3].endswith("| 3.00× / 1.50× |")


def test_stage_medians_skip_warm_up_and_pool_runs():
    step = lambda gen, upd: {"timing_s/gen": gen, "timing_s/update_actor": upd, "perf/x": 9.0}
    runs = [
        {"warmup": 1, "metrics": [step(50.0, 50.0), step(1.0, 4.0), step(3.0, 6.0)]},
        {"warmup": 1, "metrics": [step(70.0, 70.0), step(2.0, 5.0)]},
    ]
    assert peers.stage_medians(runs) == {"gen": 2.0, "update_actor": 5.0}


def test_markdown_table_lists_hybridjax_stages_under_the_ratios():
    row = {"step_time_s": 2.0, "step_cpu_time_s": 3.0, "tokens_per_step": 100, "tokens_per_s": 50}
    mine = row | {"stages_s": {"gen": 0.25, "update_actor": 0.5, "step": 0.8}}
    summary = {"workloads": {"qs": {"num_params": 3.4e6, "systems": {"hybridjax": mine}}}}
    lines = peers.markdown_table(summary).splitlines()
    header = lines.index("| workload | " + " | ".join(peers.STAGE_COLUMNS) + " |")
    cells = lines[header + 2].split(" | ")
    assert cells[0] == "| qs" and cells[1] == "0.250" and cells[-1] == "0.800 |"
    assert cells[peers.STAGE_COLUMNS.index("update_actor") + 1] == "0.500"


def test_step_flops_counts_each_model_pass():
    # 1 layer, D=4, F=8, H=K=1, Dh=4, V=8, untied: layer = 4·4·3 + 4·4 + 3·4·8 + 2·4 = 168,
    # matmul params = 168 + 4 (final norm) + 8·4 (head) = 204. One row of 2 tokens:
    # training = 6·204·2 + 12·4·4·1·1 = 2448 + 192 = 2640.
    cfg = ModelConfig(
        vocab_size=8,
        hidden_size=4,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
    )
    lens = np.array([2.0])
    train = 2640.0
    assert throughput.step_flops(cfg, None, lens, 1, False) == pytest.approx(train + 2 * train / 3)
    assert throughput.step_flops(cfg, None, lens, 2, True) == pytest.approx(2 * train + train)
    on_policy = throughput.step_flops(cfg, None, lens, 1, False, old_log_prob=False)
    assert on_policy == pytest.approx(train + train / 3)  # rollout forward only
    with_critic = throughput.step_flops(cfg, cfg, lens, 1, False)
    assert with_critic == pytest.approx(train + 2 * train / 3 + train + train / 3)


def test_scalability_points_are_three_sweeps_through_one_base_point():
    cfg = ConfigDict(
        dict(
            batches="2,8",
            response_lengths="16,64",
            devices="1,4",
            base_batch=8,
            base_response_length=64,
        )
    )
    pts = scalability.points(cfg)
    assert pts[0] == {"batch": 8, "response_length": 64, "devices": 1}
    assert len(pts) == 4  # base + batch 2 + length 16 + 4 devices
    assert {"batch": 8, "response_length": 64, "devices": 4} in pts


def test_point_overrides_split_the_batch_over_devices():
    o = scalability.point_overrides(batch=4, response_length=32, devices=2, n=4)
    assert o["data.train_batch_size"] == 4
    assert o["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == 8
    assert o["actor_rollout_ref.rollout.response_length"] == 32
    with pytest.raises(ValueError, match="do not split over 3 devices"):
        scalability.point_overrides(batch=1, response_length=8, devices=3, n=4)


def test_algorithm_overrides_select_estimator_and_critic():
    assert algorithm.algorithm_overrides("ppo", 4)["critic.enable"] is True
    assert algorithm.algorithm_overrides("ppo", 4)["actor_rollout_ref.rollout.n"] == 1
    assert algorithm.algorithm_overrides("rloo", 4)["algorithm.adv_estimator"] == "rloo"
    with pytest.raises(ValueError, match="known: grpo, rloo, ppo"):
        algorithm.algorithm_overrides("dpo", 4)


def test_results_dir_is_a_new_timestamped_folder(tmp_path):
    a, b = run.results_dir(tmp_path), run.results_dir(tmp_path)
    assert a != b and a.is_dir() and b.is_dir()
    assert len(a.name.split("_")[0]) == 8 and len(a.name.split("_")[1]) == 6  # YYYYMMDD_HHMMSS


def test_unknown_benchmark_lists_the_known_ones():
    with pytest.raises(ValueError, match="known: throughput, scalability"):
        run.run_benchmark(ConfigDict(dict(benchmark="nope")))


# ---------------------------------------------------------------------------------- smoke


def _check_results(out: pathlib.Path, pngs: list[str]) -> dict:
    for name in ["summary.json", "config.json", "log.txt", *pngs]:
        assert (out / name).is_file(), name
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_throughput_smoke(tmp_path):
    cfg = ConfigDict(
        dict(
            benchmark="throughput",
            results_root=str(tmp_path),
            throughput=dict(
                workload="tiny",
                trainer_config="",
                overrides="",
                warmup=0,
                steps=1,
                devices=0,
                profile=True,
            ),
        )
    )
    out = run.run_benchmark(cfg)
    s = _check_results(out, ["stages.png", "steps.png", "host_profile.svg", "host_profile.pstats"])
    assert any((out / "trace").rglob("*.xplane.pb"))  # the JAX profiler trace of the step
    (step,) = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    names = [e["stage"] for e in step["bench/stages"]]
    assert names[0] == "gen" and "update_actor" in names and names[-1] == "step"
    assert all(0 <= e["start_s"] <= e["end_s"] for e in step["bench/stages"])
    stages = {e["stage"]: e for e in step["bench/stages"]}
    # per stage: peak memory (the process's resident peak on CPU) and, for the jitted device
    # stages, XLA's memory analysis and the collectives of the program over 8 devices
    assert all(e["host_peak_rss_bytes"] > 0 for e in stages.values())
    update = stages["update_actor"]["compiled"]
    assert update["scratch_bytes"] > 0 and update["donated_bytes"] > 0
    assert update["collective_bytes"]["all-reduce"] > 0  # gradients summed over data shards
    assert stages["reshard"]["reshard_bytes"] == s["communication"]["reshard_bytes"]
    assert s["communication"]["collective_bytes"]["update_actor"] == update["collective_bytes"]
    # seconds per device in collectives, from the profiled step's trace: the gradient
    # all-reduce of the update is inside the step's span too
    times = s["communication"]["collective_time_s"]
    assert 0 < times["update_actor"]["all-reduce"] <= times["step"]["all-reduce"]
    assert sum(times["step"].values()) < s["step_time_s"]
    peak = stages["update_actor"]["host_peak_rss_bytes"]
    assert s["stage_peak_memory_bytes"]["update_actor"] == peak
    assert s["stability"]["steps"] == 1 and s["communication"]["reshard_bytes"] > 0
    assert s["peak_memory_bytes"]["host"] >= max(s["stage_peak_memory_bytes"].values())
    assert s["devices"] == 8 and s["tokens_per_step"] == 8 * 4 * (16 + 8)
    for key in ("step_time_s", "tokens_per_s", "mfu_actor", "mfu_step", "peak_flops_per_device"):
        assert np.isfinite(s[key]) and s[key] > 0, key
    assert {"gen", "update_actor", "reshard"} <= set(s["stages_s"])
    # one optimizer step per RL step: the separate old-log-prob pass is skipped
    assert not s["old_log_prob_pass"] and "old_log_prob" not in s["stages_s"]


@pytest.mark.slow
def test_scalability_smoke(tmp_path):
    cfg = ConfigDict(
        dict(
            benchmark="scalability",
            results_root=str(tmp_path),
            scalability=dict(
                workload="tiny",
                batches="",
                response_lengths="",
                devices="2",
                base_batch=2,
                base_response_length=8,
                warmup=0,
                steps=1,
                timeout_s=900,
            ),
        )
    )
    s = _check_results(run.run_benchmark(cfg), ["scalability.png"])
    got = [(p["response_length"], p["devices"]) for p in s["points"]]
    assert got == [(8, 1), (8, 2)]
    assert all(p["step_time_s"] > 0 for p in s["points"])


@pytest.mark.slow
def test_algorithm_smoke(tmp_path):
    cfg = ConfigDict(
        dict(
            benchmark="algorithm",
            results_root=str(tmp_path),
            algorithm=dict(
                trainer_config="",
                workload="tiny",
                algorithms="grpo,ppo,rloo",
                n=4,
                steps=1,
                test_freq=1,
                overrides="",
            ),
        )
    )
    s = _check_results(run.run_benchmark(cfg), ["algorithm.png"])
    assert set(s["curves"]) == {"grpo", "ppo", "rloo"}
    for curve in s["curves"].values():
        assert [p["step"] for p in curve] == [0, 1]
        assert all(0.0 <= p["val_acc"] <= 1.0 for p in curve)


@pytest.mark.slow
def test_peer_comparison_hybridjax_side_smoke(tmp_path):
    cfg = ConfigDict(
        dict(
            benchmark="peers",
            results_root=str(tmp_path),
            peers=dict(
                workloads="tiny",
                systems="hybridjax",
                rounds=1,
                steps=1,
                torch_threads=1,
                timeout_s=900,
            ),
        )
    )
    s = _check_results(run.run_benchmark(cfg), ["peers.png"])
    row = s["workloads"]["tiny"]["systems"]["hybridjax"]
    assert row["tokens_per_step"] == 8 * 4 * (16 + 8) and row["timed_steps"] == 1


@pytest.mark.slow
def test_generation_smoke(tmp_path):
    from experiments.benchmarks.generation import default_config

    quick = default_config(quick=True)
    quick.update(dict(batches="2", repeats=1, requests=8, new_tokens=12))
    cfg = ConfigDict(dict(benchmark="generation", results_root=str(tmp_path), generation=quick))
    s = _check_results(run.run_benchmark(cfg), ["generation.png"])
    row = s["models"]["tiny"]["batches"]["2"]
    for key in ("hybridjax_tok_s", "hf_tok_s", "ratio", "hybridjax_roofline"):
        assert np.isfinite(row[key]) and row[key] > 0, key
    c = s["continuous"]
    assert c["tokens"] == c["lengths"]["mean"] * 8
    # static batches run every wave to its longest response: never fewer steps
    assert c["decode_steps_static"] >= c["decode_steps_continuous"] > 0


@pytest.mark.slow
def test_memory_planner_update_is_within_a_quarter_of_the_measured_cpu_peak(tmp_path):
    cfg = ConfigDict(
        dict(
            benchmark="memory",
            results_root=str(tmp_path),
            memory=dict(
                models="256x4",  # smaller models: the runtime's one-off allocations dominate
                batch=8,
                n=4,
                prompt_length=64,
                response_length=64,
                micro_batch=8,
                timeout_s=900,
            ),
        )
    )
    s = _check_results(run.run_benchmark(cfg), ["memory.png"])
    (point,) = s["points"]
    for stage in ("old_log_prob", "update_actor"):
        assert point[stage]["measured_bytes"] > 0
    # the update's live bytes (gradients, optimizer step, activations) dominate its peak
    assert abs(point["update_actor"]["error"]) < 0.25, point["update_actor"]
    # a small forward's peak also holds the runtime's one-off allocations of a first
    # execution, which the count leaves out (docs/memory-planner.md)
    forward = point["old_log_prob"]
    assert 0 < forward["predicted_bytes"] <= forward["measured_bytes"], forward


@pytest.mark.slow
def test_integration_smoke(tmp_path):
    cfg = ConfigDict(
        dict(
            benchmark="integration",
            results_root=str(tmp_path),
            integration=dict(
                model="tiny",
                repeats=1,
                loading_copies=1,
                reward_parts="",  # the parts' own tests: tests/experiments/test_reward_service.py
                reward_warmup=0,
                reward_steps=1,
            ),
        )
    )
    s = _check_results(run.run_benchmark(cfg), ["integration.png"])
    c = s["checkpoint"]
    assert c["disk_bytes"] > 0 and 0 < c["save_s"] <= c["save_total_s"] and c["restore_s"] > 0
    assert s["loading"]["rows"] == 7473
    for fmt in ("parquet", "arrow_ipc"):
        assert s["loading"][fmt]["file_bytes"] > 0 and s["loading"][fmt]["read_s"] > 0
    assert s["reward_service"] == {}


def test_integration_runs_the_named_reward_service_parts(monkeypatch):
    from experiments.benchmarks import integration, reward_service

    calls = []
    monkeypatch.setattr(reward_service, "rule_part", lambda w, n: calls.append((w, n)) or {"x": 1})
    assert integration.reward_service_times("rule", 2, 5) == {"rule": {"x": 1}}
    assert calls == [(2, 5)]
    with pytest.raises(ValueError, match="unknown \\['rules'\\]; known: rule, model"):
        integration.reward_service_times("rule,rules", 0, 1)


@pytest.mark.slow
def test_batch_sweep_smoke(tmp_path):
    cfg = ConfigDict(
        dict(
            benchmark="batch_sweep",
            results_root=str(tmp_path),
            batch_sweep=dict(
                trainer_config="configs/quickstart.py",
                plan_config="configs/quickstart.py",
                plan_overrides="",
                batches="16",
                plan_batches="16,32",  # multiples of the quick start's mini-batch (16)
                devices=1,
                device_memory_gb=0.05,
                measure=True,
                warmup=0,
                steps=1,
                timeout_s=900,
            ),
        )
    )
    s = _check_results(run.run_benchmark(cfg), ["batch_sweep.png"])
    assert set(s["planned"]) == {"16", "32"} and s["measured"]["16"]["steps_per_hour"] > 0
    peaks = [s["planned"][b]["peak_bytes"] for b in ("16", "32")]
    assert peaks[0] < peaks[1]  # a larger rollout batch needs more memory
    over = [int(b) for b, p in s["planned"].items() if p["peak_bytes"] > 0.05e9]
    assert [int(b) for b, p in s["planned"].items() if not p["fits"]] == over
    assert s["first_batch_out_of_memory"] == (min(over) if over else None)
