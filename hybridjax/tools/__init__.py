"""hybridjax.tools: tools for multi-turn rollouts (registry, verl's tool config file, call
parsers, host execution with timeouts, built-in calculator and Python sandbox)."""

from hybridjax.tools.base import TOOL_CLASSES, Tool, ToolCall, register_tool
from hybridjax.tools.config import load_tools
from hybridjax.tools.executor import ToolExecutor, ToolResult
from hybridjax.tools.parser import ParseError, get_parser

__all__ = [
    "TOOL_CLASSES",
    "ParseError",
    "Tool",
    "ToolCall",
    "ToolExecutor",
    "ToolResult",
    "get_parser",
    "load_tools",
    "register_tool",
]
