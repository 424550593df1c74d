"""Parsers of tool calls in generated text (pluggable by name, verl's `format`).

`hermes` (Qwen2.5, Hermes): every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
block of the assistant's turn. A block that is not such JSON becomes a `ParseError` entry, so
the model is told its call was malformed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable

from hybridjax.tools.base import ToolCall


@dataclasses.dataclass(frozen=True)
class ParseError:
    """A malformed call: the text between the tags and why it failed."""

    text: str
    reason: str


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall | ParseError]:
    """The calls of one assistant turn in the Hermes format, in order."""
    calls: list[ToolCall | ParseError] = []
    for block in _HERMES.findall(text):
        try:
            obj = json.loads(block)
        except json.JSONDecodeError as e:
            calls.append(ParseError(block.strip(), f"invalid JSON: {e}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ParseError(block.strip(), "expected an object with a string 'name'"))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                calls.append(ParseError(block.strip(), f"invalid JSON arguments: {e}"))
                continue
        if not isinstance(args, dict):
            calls.append(ParseError(block.strip(), "'arguments' must be an object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


PARSERS: dict[str, Callable[[str], list[ToolCall | ParseError]]] = {"hermes": parse_hermes}


def get_parser(name: str) -> Callable[[str], list[ToolCall | ParseError]]:
    """The parser called `name`; raises ValueError listing the known ones."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call format {name!r}; expected one of {sorted(PARSERS)}")
    return PARSERS[name]
