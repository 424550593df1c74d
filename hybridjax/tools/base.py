"""Tools a model calls during a multi-turn rollout: the `Tool` interface, a parsed `ToolCall`,
and the registry of tool classes that verl's tool config file names.

A tool is an OpenAI function schema (what the chat template shows the model) plus `execute`,
which runs on the host and returns the text the model reads back. Tools raise on bad input;
`hybridjax.tools.executor` turns every error into a tool message, never a crash.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call parsed from generated text: the function name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]


class Tool:
    """Base class of tools. Subclasses set `default_schema` (an OpenAI function schema,
    `{"type": "function", "function": {"name", "description", "parameters"}}`) and implement
    `execute`. `config` is the tool's `config` mapping from the tool config file."""

    default_schema: dict[str, Any] = {}

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None):
        self.config = dict(config or {})
        self.schema = schema or self.default_schema
        if self.schema.get("type") != "function" or "name" not in self.schema.get("function", {}):
            raise ValueError(
                f"{type(self).__name__}: a tool schema needs type 'function' and a name"
            )

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    def execute(self, arguments: dict[str, Any]) -> str:
        """Runs the call; returns the response text. Raises on bad arguments or failures."""
        raise NotImplementedError


TOOL_CLASSES: dict[str, type[Tool]] = {}


def register_tool(name: str):
    """Class decorator: makes a tool class reachable as `class_name: <name>` in a tool config."""

    def wrap(cls: type[Tool]) -> type[Tool]:
        TOOL_CLASSES[name] = cls
        return cls

    return wrap
