"""The placement benchmark's pieces that need no training run: both modes' trainer configs
pass the start-up check on 8 devices, and the timeline plot draws from a summary."""

from __future__ import annotations

import importlib.util
import pathlib

from experiments.benchmarks import placement
from hybridjax.rl.checks import validate

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench_config():
    path = ROOT / "experiments" / "configs" / "bench_placement.py"
    spec = importlib.util.spec_from_file_location("bench_placement", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config().placement


def test_both_modes_configs_pass_the_start_up_check(tmp_path):
    cfg = _bench_config()
    for name, (mode, split) in placement.MODES.items():
        trainer_cfg = placement._trainer_config(cfg, name, tmp_path, 8)
        validate(trainer_cfg, 8)
        assert trainer_cfg.trainer.rollout_mode == mode
        assert trainer_cfg.placement.rollout == ("rollout_pool" if split else "global_pool")
    assert dict(trainer_cfg.resource_pool.rollout_pool) == {"n_devices": 4}


def test_timeline_plot(tmp_path):
    span = lambda row, stage, n, s, e: dict(row=row, stage=stage, step=n, start=s, end=e)
    runs = {
        "sync": dict(
            steps_per_hour=100.0,
            tokens_per_s=50.0,
            timeline=[span("all devices", "gen", 1, 0, 1), span("all devices", "train", 1, 1, 2)],
        ),
        "one_step_off": dict(
            steps_per_hour=150.0,
            tokens_per_s=75.0,
            timeline=[
                span("rollout pool", "gen", 2, 0, 1),
                span("training pool", "train", 1, 0, 2),
            ],
        ),
    }
    placement.plot({"runs": runs, "warmup": 0}, tmp_path)
    assert (tmp_path / "timeline.png").stat().st_size > 0
