"""The shape of the step: `train_step` calls the stages in the diagram's order, `STAGES` and the
docs list them so, and no stage reaches into the trainer (stages read `StepDeps` and return
what they change)."""

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
STAGE_MODULES = (
    "rl/step.py",
    "rl/host_stages.py",
    "rl/pipeline.py",
    "rl/dynamic_sampling.py",
    "rl/reward.py",
)
REPO = pathlib.Path(hybridjax.__file__).parents[1]


def _points_of(fn) -> list[str]:
    """The stages `fn` runs the user's stages before (`user.before(STAGE, ...)`), in the order
    of its source, each once."""
    tree = ast.parse(inspect.getsource(fn))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    hooks = [c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == "before"]
    points = sorted(hooks, key=lambda c: (c.lineno, c.col_offset))
    return list(dict.fromkeys(c.args[0].id for c in points))


def _is_config(node: ast.expr) -> bool:
    """`cfg`, `c`, `config` or `<x>.config`: the ConfigDict, whose `trainer.*` keys are fine."""
    if isinstance(node, ast.Name):
        return node.id in ("cfg", "c", "config")
    return isinstance(node, ast.Attribute) and node.attr == "config"


def test_train_step_calls_every_default_stage_in_the_diagrams_order():
    stages = [getattr(step, p).name for p in _points_of(step.train_step)]
    assert stages == DIAGRAM
    assert [s.name for s in step.STAGES] == DIAGRAM  # the one list of the stages


def test_the_docs_list_the_stages_in_their_order():
    arrows = [w for name in DIAGRAM for w in (name, "→")][:-1]
    page = (REPO / "docs" / "architecture.md").read_text()
    assert page.split("<!-- stages -->")[1].split("<!-- /stages -->")[0].split() == arrows
    docstring = step.__doc__.split("\n\n")[1]  # the module's own copy, below its first line
    assert docstring.split() == arrows


def test_train_step_reads_top_to_bottom_on_two_screens():
    lines, _ = inspect.getsourcelines(step.train_step)
    assert len(lines) <= 100, len(lines)


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
