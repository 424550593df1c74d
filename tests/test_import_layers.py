"""The package's modules import each other without a cycle and along the layers of
pyproject.toml's import-linter contract (docs/architecture.md), counting the imports inside
functions and under `if TYPE_CHECKING:` too (`experiments/import_graph.py` reads them from the
source)."""

import pathlib
import tomllib

import pytest

from experiments.import_graph import (
    ROOT,
    contract_layers,
    cycles,
    import_graph,
    layer_violations,
)


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_package_has_no_import_cycle(graph):
    assert len(graph) > 100 and "hybridjax.rl.trainer" in graph
    assert cycles(graph) == []


def test_every_import_goes_down_the_layers(graph):
    layers = contract_layers()
    assert layers[0] == [f"hybridjax.{m}" for m in ("train", "sft", "dpo", "plan")]
    assert layer_violations(graph, layers) == []


def test_the_offline_trainers_and_the_config_stay_below_the_rl_trainer(graph):
    for module, imported in graph.items():
        if module.startswith(("hybridjax.offline", "hybridjax.config", "hybridjax.training")):
            assert not {m for m in imported if m.startswith("hybridjax.rl")}, module


def test_the_architecture_page_draws_the_contracts_layers():
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## The layers", 1)[1].split("```")[1]
    drawn = [line.split("  ")[0].strip() for line in block.strip().splitlines()]
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in contracts["contracts"] if c["type"] == "layers"]
    assert drawn == layers


def _package(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cycle_through_a_function_or_a_package_init_is_found(tmp_path):
    """The check can fail: `a` → `b` at the top, `b` → `a` inside a function; and `c.x`
    importing `a` while `a` imports `c.y`, whose package `c` re-exports `x`."""
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg import b\nfrom pkg.c.y import Y\n",
            "b.py": "def f():\n    from pkg.a import A\n",
            "c/__init__.py": "from pkg.c.x import X\n",
            "c/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
            "c/y.py": "Y = 1\n",
        },
    )
    graph = import_graph(root, "pkg")
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.a"] == {"pkg.b", "pkg.c.y", "pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.c.x"]]
    assert cycles(import_graph(root, "pkg", nested=False)) == []  # function-level only
    assert layer_violations(graph, [["pkg.a"], ["pkg.b"]]) == [("pkg.b", "pkg.a")]
