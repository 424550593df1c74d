"""verl's tool config file (`actor_rollout_ref.rollout.multi_turn.tool_config_path`):

tools:
  - class_name: calculator            # a registered name, or "package.module.Class"
    config: {type: native}            # passed to the tool
    tool_schema:                      # OpenAI function schema (optional for built-ins)
      type: function
      function: {name: calculator, description: ..., parameters: {...}}
"""

from __future__ import annotations

import importlib
import os

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
    """A registered tool class (or verl's class path of one), or one imported from a dotted
    path; ValueError otherwise."""
    name = VERL_CLASSES.get(name, name)
    if name in TOOL_CLASSES:
        return TOOL_CLASSES[name]
    module, _, attr = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr) if module else None
    except (ImportError, AttributeError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ValueError(
            f"{where}: class_name {name!r} is neither a built-in tool ({sorted(TOOL_CLASSES)}) "
            "nor an importable subclass of hybridjax.tools.Tool"
        )
    return cls


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
