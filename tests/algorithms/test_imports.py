"""The modules of `hybridjax.algorithms` import each other one way: no cycle, counting imports
under `if TYPE_CHECKING:` too (`registry` ← `config` ← `advantages`, `losses`, `kl`, ...)."""

import ast
import pathlib

import hybridjax.algorithms

PACKAGE = pathlib.Path(hybridjax.algorithms.__file__).parent


def _imports() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.glob("*.py"):
        if path.stem == "__init__":
            continue
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "hybridjax.algorithms."
            ):
                found.add((node.module or "").rsplit(".", 1)[1])
        graph[path.stem] = found
    return graph


def test_algorithm_modules_import_without_a_cycle():
    graph, done, stack = _imports(), set(), []

    def visit(module):
        assert module not in stack, f"import cycle: {' → '.join([*stack, module])}"
        if module in done:
            return
        stack.append(module)
        for dependency in graph[module]:
            visit(dependency)
        stack.pop()
        done.add(module)

    for module in graph:
        visit(module)
    assert graph["registry"] == set()
    assert not graph["config"] & {"advantages", "losses", "kl"}
