"""Mistakes found at start-up, before any model is built or any step runs: a `data_source`
with no reward function, a run directory another run holds."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridjax.errors import ConfigError
from hybridjax.rewards.registry import check_data_sources
from hybridjax.rl.trainer import RLTrainer
from hybridjax.training import build
from tests.rl.tiny_run import gsm8k_subset, tiny_config


def test_unknown_data_sources_are_named_per_key():
    check_data_sources({"data.train_files": {"openai/gsm8k", "math"}}, custom=False)
    check_data_sources({"data.train_files": {"mine"}}, custom=True)  # a custom function
    with pytest.raises(ConfigError) as err:
        check_data_sources(
            {"data.train_files": {"openai/gsm8k", "mine"}, "data.val_files": {"theirs"}}, False
        )
    message = str(err.value)
    assert "data.train_files: data_source ['mine'] has no reward function" in message
    assert "data.val_files: data_source ['theirs']" in message
    assert "'openai/gsm8k'" in message and "custom_reward_function.path" in message


def _relabel(path: str, source: str) -> None:
    table = pq.read_table(path)
    column = pa.array([source] * table.num_rows)
    pq.write_table(
        table.set_column(table.column_names.index("data_source"), "data_source", column), path
    )


def test_trainer_refuses_an_unknown_data_source_before_building_models(tmp_path, monkeypatch):
    data = gsm8k_subset(tmp_path, train_rows=16, test_rows=8)
    _relabel(data["test"], "openai/gsm8k-typo")

    def no_models(*args, **kwargs):
        raise AssertionError("models built before the data sources were checked")

    monkeypatch.setattr(build, "build_models", no_models)
    with pytest.raises(ConfigError, match=r"data.val_files: data_source \['openai/gsm8k-typo'\]"):
        RLTrainer(tiny_config(data, tmp_path / "run"))
