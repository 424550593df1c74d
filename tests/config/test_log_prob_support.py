"""`actor_rollout_ref.rollout.log_prob_support` and `algorithm.rollout_rs`: resolved once
(`hybridjax.training.build`), checked at start-up beside their fields
(`hybridjax.config.checks`)."""

from __future__ import annotations

import pytest

from hybridjax.config.checks import ConfigError
from hybridjax.rl.checks import validate
from hybridjax.training import build
from tests.rl.tiny_run import load_config_file


def _config(tmp_path, **changes):
    cfg = load_config_file("tiny")
    for key in ("train_files", "val_files"):
        (tmp_path / f"{key}.parquet").touch()
        cfg.data[key] = str(tmp_path / f"{key}.parquet")
    cfg.update_from_flattened_dict(changes)
    return cfg


@pytest.mark.parametrize(
    "changes, replays",
    [
        ({}, False),  # no truncation: nothing to replay
        ({"top_p": 0.8}, True),
        ({"top_k": 20}, True),
        ({"top_k": 20, "do_sample": False}, False),  # greedy rows are never truncated
        ({"top_p": 0.8, "log_prob_support": "full"}, False),
        ({"log_prob_support": "replay"}, True),
        ({"top_p": 0.8, "multi_turn.enable": True}, False),  # not recorded there
    ],
)
def test_auto_replays_when_sampling_truncates(tmp_path, changes, replays):
    rollout = {f"actor_rollout_ref.rollout.{k}": v for k, v in changes.items()}
    assert build.replays_sampling_mask(_config(tmp_path, **rollout)) is replays


def test_start_up_checks(tmp_path):
    cfg = _config(tmp_path, **{
        "actor_rollout_ref.rollout.log_prob_support": "replay",
        "actor_rollout_ref.rollout.multi_turn.enable": True,
    })  # fmt: skip
    with pytest.raises(ConfigError, match="log_prob_support='replay': multi-turn rollouts"):
        validate(cfg, 1)
    cfg = _config(tmp_path, **{"actor_rollout_ref.rollout.log_prob_support": "always"})
    with pytest.raises(ConfigError, match=r"log_prob_support: one of \('auto', 'replay'"):
        validate(cfg, 1)
    cfg = _config(tmp_path, **{"algorithm.rollout_rs": "icepops"})
    with pytest.raises(ConfigError, match="rollout_rs: one of .*'icepop'"):
        validate(cfg, 1)
    cfg = _config(tmp_path, **{"algorithm.rollout_rs": "icepop"})
    assert build.recompute_old_log_prob(cfg)  # π_old before the update: its own pass
    assert build.stage_config(cfg, 1, 1).algorithm.rollout_rs == "icepop"
