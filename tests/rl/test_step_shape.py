"""The shape of the step: `train_step` names the stages in the diagram's order, and no stage
reaches into the trainer (stages read `StepDeps` and replace what they change on the context)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib

import hybridjax
from hybridjax.rl import step
from hybridjax.rl.pipeline import StepContext

DIAGRAM = (
    "gen sleep reward filter_groups old_log_prob ref teacher values adv update_critic "
    "update_actor reshard onload"
).split()
STAGE_MODULES = ("rl/step.py", "rl/pipeline.py", "rl/dynamic_sampling.py", "rl/reward.py")
REPO = pathlib.Path(hybridjax.__file__).parents[1]


def _calls_of(fn, name: str) -> list[ast.Call]:
    tree = ast.parse(inspect.getsource(fn))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    return [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == name]


def _is_config(node: ast.expr) -> bool:
    """`cfg`, `c`, `config` or `<x>.config`: the ConfigDict, whose `trainer.*` keys are fine."""
    if isinstance(node, ast.Name):
        return node.id in ("cfg", "c", "config")
    return isinstance(node, ast.Attribute) and node.attr == "config"


def test_train_step_names_every_default_stage_in_the_diagrams_order():
    points = [c.args[0].id for c in _calls_of(step.train_step, "at")]
    stages = [getattr(step, p).name for p in points]
    assert len(set(points)) == len(points)  # each named once
    assert stages == DIAGRAM


def test_train_step_fits_on_a_screen():
    lines, _ = inspect.getsourcelines(step.train_step)
    assert len(lines) <= 40, len(lines)


def test_no_stage_refers_to_the_trainer():
    assert "trainer" not in {f.name for f in dataclasses.fields(StepContext)}
    assert "trainer" not in {f.name for f in dataclasses.fields(step.StepDeps)}
    stage_files = [REPO / "hybridjax" / m for m in STAGE_MODULES]
    stage_files += sorted((REPO / "configs" / "stages").glob("*.py"))
    for path in stage_files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("trainer", "_update_weights"):
                assert _is_config(node.value), (path, node.lineno)  # `cfg.trainer.*` keys only
            if isinstance(node, ast.ImportFrom):
                assert node.module != "hybridjax.rl.trainer", (path, node.lineno)
