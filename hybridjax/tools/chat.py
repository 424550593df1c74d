"""Tools for chat models: the `TurnHandler` of `hybridjax.rollout.agent_loop` built from a
tokenizer, a tool-call format and a `ToolExecutor`.

Token in, token out: an assistant turn's calls are parsed from its decoded text (special tokens
kept), and each tool response is rendered once with the chat template's `tool` role and
tokenized on its own; nothing generated before is re-tokenized. The rendering is the template's
text for [system, tool messages] with the generation prompt, less its text for [system] (as
verl does), preceded by what the template writes after an end-of-turn token (Qwen/ChatML: a
newline), since the model's turn stopped at that token.
"""

from __future__ import annotations

from typing import Any

from hybridjax.models.tokenizer import Tokenizer
from hybridjax.tools.base import ToolCall
from hybridjax.tools.executor import ToolExecutor, ToolResult
from hybridjax.tools.parser import ParseError, get_parser

_SYSTEM = [{"role": "system", "content": "x"}]


def tool_response_text(tokenizer: Tokenizer, contents: list[str]) -> str:
    """The text that follows an assistant turn (ended by its EOS token) whose calls answered
    `contents`: the chat template's text for [system, tool messages] with the generation prompt,
    less its text for [system], preceded by what the template writes after an end-of-turn
    token (ChatML: "\n"). Raises ValueError when the template renders the system message
    differently in context (no such split exists)."""
    prefix = tokenizer.render_chat(_SYSTEM, add_generation_prompt=False)
    eos_id = tokenizer.eos_token_id
    eos = None if eos_id is None else tokenizer.backend.id_to_token(eos_id)
    separator = prefix[prefix.rfind(eos) + len(eos) :] if eos and eos in prefix else ""
    full = tokenizer.render_chat(_SYSTEM + [{"role": "tool", "content": c} for c in contents])
    if not full.startswith(prefix):
        raise ValueError("the chat template renders the system message differently in context")
    return separator + full[len(prefix) :]


class ChatTools:
    """Parses, executes and renders tool calls for one tokenizer.

    Args:
      tokenizer: with a chat template and an EOS token (the end of an assistant turn).
      executor: runs the calls (timeouts, errors as messages, truncation).
      format: the tool-call format (`hybridjax.tools.parser.PARSERS`), verl's `format`.
    """

    def __init__(self, tokenizer: Tokenizer, executor: ToolExecutor, format: str = "hermes"):
        self.tokenizer = tokenizer
        self.executor = executor
        self.parser = get_parser(format)

    def parse(self, turn_ids: list[int]) -> list[ToolCall | ParseError]:
        return self.parser(self.tokenizer.decode(turn_ids, skip_special_tokens=False))

    def execute(self, calls: list[ToolCall | ParseError]) -> list[ToolResult]:
        return self.executor.run(calls)

    def is_error(self, result: ToolResult) -> bool:
        return result.error

    def messages(self, results: list[ToolResult]) -> list[dict[str, Any]]:
        return [{"role": "tool", "content": r.text} for r in results]

    def render_text(self, results: list[ToolResult]) -> str:
        """The text appended after an assistant turn that called tools."""
        return tool_response_text(self.tokenizer, [r.text for r in results])

    def render(self, calls, results: list[ToolResult]) -> list[int]:
        return self.tokenizer.encode(self.render_text(results))
