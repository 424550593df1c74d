"""The package's module import graph, read from the source (no module is imported).

Every `import` / `from ... import` in a module counts: at the top, inside a function, under
`if TYPE_CHECKING:`. `from hybridjax.a import b` is an edge to the module `hybridjax.a.b` if
there is one, else to the package `hybridjax.a` (its `__init__`). Importing `hybridjax.a.b` also
runs `hybridjax.a`'s `__init__`, but that edge is not drawn: a package that re-exports its
modules would otherwise form a cycle with each of them, which Python resolves by design.

    python -m experiments.import_graph            # cycles, then edges that break the layers
    python -m experiments.import_graph --edges    # every edge between top-level parts

The layers are those of pyproject.toml's `[tool.importlinter]` contract (docs/architecture.md).
"""

import argparse
import ast
import pathlib
import sys
import tomllib
from collections.abc import Iterable

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "hybridjax"


def modules(root: pathlib.Path = ROOT, package: str = PACKAGE) -> dict[str, pathlib.Path]:
    """Every module of `package` under `root`: dotted name -> file (a package is its `__init__`)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterable[str]:
    """The dotted names one import statement names (absolute; `from x import y` as `x.y` and
    `x`, the caller keeps whichever is a module)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against this module's package
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            yield f"{target}.{alias.name}"
        yield target


def _statements(tree: ast.Module, nested: bool) -> Iterable[ast.AST]:
    """The import statements of a module: all of them, or (`nested=False`) those that run when
    it is imported (not in a function or class body, not under `if TYPE_CHECKING:`)."""
    if nested:
        yield from (n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom))
        return
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                todo.extend(node.body)
            todo.extend(node.orelse)
        elif isinstance(node, ast.Try):
            todo.extend(node.body + node.orelse + node.finalbody)
            todo.extend(s for h in node.handlers for s in h.body)
        elif isinstance(node, ast.With):
            todo.extend(node.body)


def import_graph(
    root: pathlib.Path = ROOT, package: str = PACKAGE, nested: bool = True, parents: bool = True
) -> dict[str, set[str]]:
    """module -> the modules of the package it imports.

    `nested`: count the imports inside functions and under `if TYPE_CHECKING:` too (else only
    those that run when the module is imported). `parents`: an import of `a.b.c` from outside
    `a.b` is an edge to the packages `a.b` and `a` too, whose `__init__` runs first (the
    packages the importer sits in are left out: they are already being imported).
    """
    found = modules(root, package)
    graph: dict[str, set[str]] = {name: set() for name in found}
    for name, path in found.items():
        is_package = path.name == "__init__.py"
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        for node in _statements(ast.parse(path.read_text(), str(path)), nested):
            names = list(_imported(node, name, is_package))
            if isinstance(node, ast.ImportFrom):
                targets = [n for n in names[:-1] if n in found]  # `from a import b`, b a module
                if len(targets) < len(names) - 1 and names[-1] in found:
                    targets.append(names[-1])  # some name is not a module: the package itself
            else:
                targets = []
                for n in names:  # `import a.b.c`: the deepest module named
                    while n and n not in found:
                        n = n.rpartition(".")[0]
                    if n:
                        targets.append(n)
            if parents:
                for t in list(targets):
                    while "." in t:
                        t = t.rpartition(".")[0]
                        if t not in own:
                            targets.append(t)
            graph[name].update(t for t in targets if t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found, key=lambda c: (-len(c), c))


def contract_layers(root: pathlib.Path = ROOT) -> list[list[str]]:
    """The layers of pyproject.toml's import-linter `layers` contract, top first, each a list of
    modules (`a | b` are independent siblings, `a : b` siblings that may import each other)."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]
    for contract in config["contracts"]:
        if contract["type"] == "layers":
            container = (contract.get("containers") or [""])[0]
            prefix = f"{container}." if container else ""
            return [
                [prefix + m.strip() for m in layer.replace(":", "|").split("|")]
                for layer in contract["layers"]
            ]
    raise LookupError("pyproject.toml has no import-linter layers contract")


def _owner(module: str, layers: list[list[str]]) -> int | None:
    for i, layer in enumerate(layers):
        if any(module == m or module.startswith(m + ".") for m in layer):
            return i
    return None


def layer_violations(graph: dict[str, set[str]], layers: list[list[str]]) -> list[tuple[str, str]]:
    """Edges from a module to one in a higher layer (`layers` top first), sorted."""
    bad = []
    for source, targets in graph.items():
        s = _owner(source, layers)
        for target in targets:
            t = _owner(target, layers)
            if s is not None and t is not None and t < s:
                bad.append((source, target))
    return sorted(bad)


def _part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", action="store_true", help="edges between top-level parts")
    args = parser.parse_args()
    graph = import_graph()
    if args.edges:
        parts: dict[tuple[str, str], int] = {}
        for source, targets in graph.items():
            for target in targets:
                if _part(source) != _part(target):
                    key = (_part(source), _part(target))
                    parts[key] = parts.get(key, 0) + 1
        for (source, target), n in sorted(parts.items()):
            print(f"{source} -> {target}  ({n})")
        return
    found = cycles(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} edges")
    print(f"{len(found)} import cycles, {sum(map(len, found))} modules in them")
    for component in found:
        print(f"  {len(component)}: {', '.join(component)}")
    try:
        layers = contract_layers()
    except (LookupError, KeyError):
        return
    bad = layer_violations(graph, layers)
    print(f"{len(bad)} imports against the layers")
    for source, target in bad:
        print(f"  {source} -> {target}")


if __name__ == "__main__":
    main()
