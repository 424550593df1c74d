"""verl's tool config file (`actor_rollout_ref.rollout.multi_turn.tool_config_path`):

tools:
  - class_name: calculator            # a registered name, or "package.module.Class" (below)
    config: {type: native}            # passed to the tool
    tool_schema:                      # OpenAI function schema (optional for built-ins)
      type: function
      function: {name: calculator, description: ..., parameters: {...}}

A `package.module.Class` is looked up before anything is imported (`tool_class`): only a module
installed or in a PYTHONPATH directory, never one in the current directory that PYTHONPATH does
not name, and only when its source defines `Class` or imports it (`from ... import Class`).
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from importlib.machinery import ModuleSpec, PathFinder

import yaml

from hybridjax.tools import calculator, sandbox, sandbox_fusion
from hybridjax.tools.base import TOOL_CLASSES, Tool

BUILTINS = (  # imported: registered
    calculator.CalculatorTool,
    sandbox.PythonTool,
    sandbox_fusion.SandboxFusionTool,
)


VERL_CLASSES = {sandbox_fusion.VERL_CLASS: "sandbox_fusion"}  # verl's class paths of built-ins


def tool_class(name: str, where: str) -> type[Tool]:
    """A registered tool class (or verl's class path of one), or `package.module.Class` from a
    module on the configured import path (installed, or in a `PYTHONPATH` directory).

    Nothing is imported before it is allowed: the module is found without running any code,
    never in the current directory unless `PYTHONPATH` names it, and must define or import the
    name `Class` in its source; only then is it imported.

    Raises:
      ValueError: one line naming `where`, the class and the registered tools.
    """
    name = VERL_CLASSES.get(name, name)
    if name in TOOL_CLASSES:
        return TOOL_CLASSES[name]
    module, _, attr = name.rpartition(".")
    reason = _refusal(module, attr) if module else "not a dotted path"
    try:
        cls = None if reason else getattr(importlib.import_module(module), attr, None)
    except (Exception, SystemExit) as e:  # its import-time code raised (or exited)
        reason = f"importing {module!r} failed: {type(e).__name__}: {_first_line(e)}"
    if not reason and not (isinstance(cls, type) and issubclass(cls, Tool)):
        reason = f"{attr} is not a subclass of hybridjax.tools.Tool"
    if reason:
        raise ValueError(
            f"{where}: class_name {name!r} is neither a registered tool ({sorted(TOOL_CLASSES)}) "
            f"nor a Tool class on the import path: {reason}"
        )
    return cls  # type: ignore[return-value]


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else ""


def _import_path() -> list[str]:
    """`sys.path` without the current directory, which Python adds implicitly (`''`, or the
    start-up directory under `python -m`); kept where the user listed it in PYTHONPATH."""
    cwd = os.path.realpath(os.getcwd())
    listed = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    explicit = {os.path.realpath(p) for p in listed if p}
    return [p for p in sys.path if p and (os.path.realpath(p) != cwd or cwd in explicit)]


def _find_spec(module: str, path: list[str]) -> ModuleSpec | None:
    """The spec of `module` on `path`, found without importing it or its parents (a module
    already imported answers with its own spec)."""
    spec, search = None, path
    parts = module.split(".")
    for i in range(len(parts)):
        full = ".".join(parts[: i + 1])
        loaded = sys.modules.get(full)
        spec = loaded.__spec__ if loaded is not None else PathFinder.find_spec(full, search)
        if spec is None or (i + 1 < len(parts) and spec.submodule_search_locations is None):
            return None
        search = list(spec.submodule_search_locations or [])
    return spec


def _refusal(module: str, attr: str) -> str:
    """Why `module.attr` may not be imported, or '' when it may."""
    spec = _find_spec(module, _import_path())
    where = "the current directory is searched only when PYTHONPATH names it"
    if spec is None:
        return f"no module {module!r} found ({where})"
    if module.split(".")[0] not in sys.modules:  # the import itself must find the same file
        shadow = _find_spec(module, sys.path)
        if shadow is None or shadow.origin != spec.origin:
            return f"{module!r} would be imported from {getattr(shadow, 'origin', None)} ({where})"
    if module in sys.modules:
        return ""
    origin = spec.origin or ""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if main and origin and os.path.realpath(main) == os.path.realpath(origin):
        return f"{module!r} is the running program (__main__); importing it would run it again"
    if not origin.endswith(".py"):
        return f"{module!r} is not Python source ({origin})"
    try:
        with open(origin, "rb") as f:
            tree = ast.parse(f.read(), origin)
    except (OSError, SyntaxError, ValueError) as e:
        return f"{origin} cannot be read: {e}"
    bound = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for node in ast.walk(tree):  # `from m import Class`; `import m` binds a module, no class
        if isinstance(node, ast.ImportFrom):
            bound |= {a.asname or a.name for a in node.names}
    return "" if attr in bound else f"{module!r} defines no {attr!r}"


def load_tools(path: str | os.PathLike) -> list[Tool]:
    """The tools of a tool config file. Raises ValueError naming the file and entry on a bad
    entry, FileNotFoundError when the file is missing."""
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    entries = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a top-level 'tools' list")
    tools = []
    for i, entry in enumerate(entries):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ValueError(f"{where}: each tool needs a 'class_name'")
        unknown = set(entry) - {"class_name", "config", "tool_schema"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        cls = tool_class(str(entry["class_name"]), where)
        try:
            tools.append(cls(entry.get("config") or {}, entry.get("tool_schema")))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
    return tools
