"""Bounds and choices declared beside the keys (`hybridjax.config.fields`): the default config,
the start-up check and the reference all read the one declaration."""

from __future__ import annotations

import pytest

from hybridjax.algorithms.advantages import ADV_ESTIMATORS
from hybridjax.config import fields
from hybridjax.config.checks import _get
from hybridjax.config.schema import base_config, declared_checks, declared_config
from hybridjax.errors import ConfigError
from hybridjax.rl.checks import validate
from tests.reliability.test_config_checks import _config, _problems


@pytest.mark.parametrize(
    "field, good, bad, rule",
    [
        (fields.positive(1), [1, 0.5], [0, -3], "must be > 0"),
        (fields.at_least(0.0, 0), [0, 2.0], [-0.1], "must be >= 0"),
        (fields.at_least(0.0, 0, "0: off"), [0], [-1], "must be >= 0 (0: off)"),
        (fields.positive_or_unset(-1), [-1, 4], [0, -2], "must be -1 or > 0"),
        (fields.within(0.5, 0, 1), [0, 1, 0.5], [-0.1, 1.1], "must be in [0, 1]"),
        (fields.within(0.5, 0, 1, low_open=True), [1, 0.1], [0, 1.5], "must be in (0, 1]"),
        (
            fields.within(0.2, 0, 1, low_open=True, high_open=True),
            [0.2],
            [0, 1],
            "must be in (0, 1)",
        ),
        (fields.one_of("a", ("a", "b")), ["a", "b"], ["c"], "one of ('a', 'b')"),
        (fields.one_of("a", ("a",), "note"), ["a"], ["b"], "one of ('a',) (note)"),
        (
            fields.subset_of(("x",), ("x", "y")),
            [(), ("y", "x")],
            [("z",)],
            "a subset of ('x', 'y')",
        ),
    ],
)
def test_each_helper_states_the_rule_it_applies(field, good, bad, rule):
    assert field.rule == rule
    assert all(field.ok(v) for v in good)
    assert not any(field.ok(v) for v in bad)


def test_choices_from_a_function_are_read_when_checked():
    names = ["a"]
    field = fields.one_of("a", lambda: tuple(names))
    assert not field.ok("b") and field.rule == "one of ['a']"
    names.append("b")
    assert field.ok("b") and field.rule == "one of ['a', 'b']"


def test_checks_walks_nested_sections_in_order():
    spec = {"a": fields.positive(1), "b": {"c": 2, "d": {"e": fields.at_least(0, 0)}}}
    assert [(k, f.rule) for k, f in fields.checks(spec)] == [
        ("a", "must be > 0"),
        ("b.d.e", "must be >= 0"),
    ]


def test_every_default_passes_its_own_check():
    cfg = base_config()
    declared = declared_checks()
    assert len(declared) >= 80  # every bound and choice of the trainer is declared
    keys = [key for key, _ in declared]
    assert len(keys) == len(set(keys))
    problems = list(fields.problems(declared, lambda key: _get(cfg, key)))
    assert problems == ["data.train_files: must name at least one parquet file (got '')"]


def test_the_default_config_holds_plain_typed_values():
    declared, cfg = declared_config(), base_config()
    assert isinstance(declared.data.train_batch_size, fields.Checked)
    assert cfg.data.train_batch_size == 1024 and cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    with pytest.raises(TypeError):
        cfg.data.train_batch_size = "many"  # ConfigDict's type safety holds for checked keys
    cfg.trainer.experiment_name = "grpo_7b"  # the run directory still follows the run's name
    assert cfg.trainer.default_local_dir == "checkpoints/hybridjax/grpo_7b"


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("data.train_batch_size", 0, "data.train_batch_size: must be > 0 (got 0)"),
        (
            "critic.optim.min_lr_ratio",
            1.5,
            "critic.optim.min_lr_ratio: must be in [0, 1] (got 1.5)",
        ),
        ("algorithm.kl_ctrl.horizon", 0, "algorithm.kl_ctrl.horizon: must be > 0 (got 0)"),
        ("algorithm.kl_ctrl.type", "pid", "algorithm.kl_ctrl.type: fixed or adaptive (got 'pid')"),
        (
            "actor_rollout_ref.actor.clip_ratio_low",
            1.0,
            "clip_ratio_low: must be in (0, 1), or 0 to follow clip_ratio (got 1.0)",
        ),
        ("trainer.logger", ("console", "mlflow"), "trainer.logger: a subset of ('console',"),
        ("trainer.save_freq", 0, "trainer.save_freq: must be -1 or > 0 (got 0)"),
    ],
)
def test_a_value_out_of_bounds_is_reported_with_its_key_and_rule(key, value, message):
    assert message in _problems(**{key: value})


def test_a_registered_estimator_is_a_valid_choice_without_editing_the_check(monkeypatch):
    assert "algorithm.adv_estimator: one of [" in _problems(**{"algorithm.adv_estimator": "mine"})
    monkeypatch.setitem(ADV_ESTIMATORS._fns, "mine", ADV_ESTIMATORS.get("grpo"))
    problems = ""
    try:
        validate(_config(**{"algorithm.adv_estimator": "mine"}), 8)
    except ConfigError as err:
        problems = str(err)
    assert "algorithm.adv_estimator" not in problems
