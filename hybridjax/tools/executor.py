"""Host execution of tool calls: a thread pool, a timeout per call, and every failure (unknown
tool, malformed call, exception, timeout) turned into a tool message the model reads, never a
crash. Responses longer than `max_response_length` characters are truncated (verl's
`max_tool_response_length` and `tool_response_truncate_side`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging

from hybridjax.tools.base import Tool, ToolCall
from hybridjax.tools.parser import ParseError

log = logging.getLogger(__name__)

TRUNCATE_SIDES = ("left", "middle", "right")


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """The text the model reads for one call, and whether the call failed."""

    text: str
    error: bool = False


def truncate(text: str, limit: int, side: str = "middle") -> str:
    """`text` cut to `limit` characters plus a "...(truncated)..." marker: keeps the start
    ("right": the end is cut), the end ("left") or both halves ("middle"), as verl."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "...(truncated)" + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - (limit - half) :]


class ToolExecutor:
    """Runs parsed calls concurrently on the host.

    Args:
      tools: the available tools (names must be unique).
      timeout_s: per call; a call still running then answers "timed out" (its thread is left
        to finish; the Python sandbox kills its own process at its limit).
      max_workers: calls running at once.
      max_response_length: characters of a response the model sees.
      truncate_side: left | middle | right.
    """

    def __init__(
        self,
        tools: list[Tool],
        timeout_s: float = 30.0,
        max_workers: int = 8,
        max_response_length: int = 256,
        truncate_side: str = "middle",
    ):
        self.tools = {}
        for t in tools:
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t
        if truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"truncate_side {truncate_side!r}; expected one of {TRUNCATE_SIDES}")
        self.timeout_s = timeout_s
        self.max_response_length = max_response_length
        self.truncate_side = truncate_side
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers, "tool")

    @property
    def schemas(self) -> list[dict]:
        """The tools' OpenAI function schemas (for the chat template's `tools`)."""
        return [t.schema for t in self.tools.values()]

    def submit(self, call: ToolCall | ParseError) -> concurrent.futures.Future[ToolResult]:
        """Starts one call; the future's result is always a `ToolResult`."""
        if isinstance(call, ParseError):
            return _done(ToolResult(f"Error: malformed tool call ({call.reason})", True))
        if call.name not in self.tools:
            known = ", ".join(sorted(self.tools))
            return _done(ToolResult(f"Error: unknown tool {call.name!r} (tools: {known})", True))
        return self.pool.submit(self.tools[call.name].execute, call.arguments)

    def run(self, calls: list[ToolCall | ParseError]) -> list[ToolResult]:
        """Runs calls concurrently; blocks until each finished or timed out (one deadline for
        all, `timeout_s` from now)."""
        futures = [self.submit(c) for c in calls]
        concurrent.futures.wait(futures, timeout=self.timeout_s)
        return [self._result(c, f) for c, f in zip(calls, futures, strict=True)]

    def _result(self, call, future) -> ToolResult:
        if not future.done():
            future.cancel()
            return ToolResult(f"Error: tool {call.name!r} timed out after {self.timeout_s} s", True)
        try:
            out = future.result()
        except Exception as e:  # noqa: BLE001 -- any tool failure is reported to the model
            log.debug("tool %s failed", getattr(call, "name", "?"), exc_info=True)
            out = ToolResult(f"Error: {type(e).__name__}: {e}", True)
        if not isinstance(out, ToolResult):
            out = ToolResult(str(out))
        text = truncate(out.text, self.max_response_length, self.truncate_side)
        return dataclasses.replace(out, text=text)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _done(result: ToolResult) -> concurrent.futures.Future[ToolResult]:
    f: concurrent.futures.Future[ToolResult] = concurrent.futures.Future()
    f.set_result(result)
    return f
