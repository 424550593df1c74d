"""Host execution of tool calls: worker processes, a deadline per call, and every failure
(unknown tool, malformed call, exception, timeout, a worker that died) turned into a tool
message the model reads, never a crash. Responses longer than `max_response_length`
characters are truncated (verl's `max_tool_response_length` and `tool_response_truncate_side`).

Calls run in a `pebble.ProcessPool` (workers forked from a `forkserver`, as the reward
functions'), never in threads of the trainer: a call still running at its deadline has its
worker process killed (and replaced), so a tool that loops, sleeps or holds the GIL in a C
routine (a huge integer power) cannot stall training. Tools travel to the workers as pickles
(checked when the executor is built); a call costs about a millisecond more than in a thread.
Nothing a tool starts outlives its worker (`hybridjax.process_tree`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import logging
import pickle
import time

import pebble

from hybridjax.process_tree import keep_descendants, reap_exited_children, worker_context
from hybridjax.tools.base import Tool, ToolCall
from hybridjax.tools.parser import ParseError

log = logging.getLogger(__name__)

TRUNCATE_SIDES = ("left", "middle", "right")
_START_S = 10.0  # how long `close` waits for workers still starting


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
      timeout_s: per call; a call still running then answers "timed out" and its worker
        process is killed.
      max_workers: calls running at once (worker processes).
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
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            _check_picklable(t)
            self.tools[t.name] = t
        if truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"truncate_side {truncate_side!r}; expected one of {TRUNCATE_SIDES}")
        self.timeout_s = timeout_s
        self.max_response_length = max_response_length
        self.truncate_side = truncate_side
        context = worker_context()
        modules = sorted({type(t).__module__ for t in tools})  # imported as each worker starts
        self._started = context.Value("i", 0)  # workers past their start-up
        self.max_workers = max_workers
        self.pool = pebble.ProcessPool(
            max_workers, initializer=_import, initargs=(modules, self._started), context=context
        )
        self.pool.schedule(_execute, (None, None)).result()  # a worker is up before any call

    @property
    def schemas(self) -> list[dict]:
        """The tools' OpenAI function schemas (for the chat template's `tools`)."""
        return [t.schema for t in self.tools.values()]

    def submit(self, call: ToolCall | ParseError) -> concurrent.futures.Future:
        """Starts one call; the future's result is a `ToolResult` or the tool's text."""
        if isinstance(call, ParseError):
            return _done(ToolResult(f"Error: malformed tool call ({call.reason})", True))
        if call.name not in self.tools:
            known = ", ".join(sorted(self.tools))
            return _done(ToolResult(f"Error: unknown tool {call.name!r} (tools: {known})", True))
        tool = self.tools[call.name]
        return self.pool.schedule(_execute, (tool, call.arguments), timeout=self.timeout_s)

    def run(self, calls: list[ToolCall | ParseError]) -> list[ToolResult]:
        """Runs calls concurrently; blocks until each finished or timed out (one deadline for
        all, `timeout_s` from now; calls still running then have their workers killed)."""
        futures = [self.submit(c) for c in calls]
        concurrent.futures.wait(futures, timeout=self.timeout_s)
        return [self._result(c, f) for c, f in zip(calls, futures, strict=True)]

    def _result(self, call, future) -> ToolResult:
        name = getattr(call, "name", "?")
        timed_out = ToolResult(f"Error: tool {name!r} timed out after {self.timeout_s} s", True)
        if not future.done():
            future.cancel()  # a running call's worker process is killed
            return timed_out
        try:
            out = future.result()
        except concurrent.futures.TimeoutError:
            return timed_out
        except pebble.ProcessExpired as e:
            out = ToolResult(f"Error: tool {name!r} crashed (exit code {e.exitcode})", True)
        except Exception as e:  # noqa: BLE001 -- any tool failure is reported to the model
            log.debug("tool %s failed", name, exc_info=True)
            out = ToolResult(f"Error: {type(e).__name__}: {e}", True)
        if not isinstance(out, ToolResult):
            out = ToolResult(str(out))
        text = truncate(out.text, self.max_response_length, self.truncate_side)
        return dataclasses.replace(out, text=text)

    def close(self) -> None:
        """Stops the workers at once (running calls are killed, not waited for), once every
        worker has started (at most `_START_S` s): a worker killed while it started printed
        multiprocessing tracebacks, the pool's semaphores being gone."""
        deadline = time.monotonic() + _START_S
        while self._started.value < self.max_workers and time.monotonic() < deadline:
            time.sleep(0.01)
        self.pool.stop()
        self.pool.join()


def _execute(tool: Tool | None, arguments: dict | None) -> str | ToolResult | None:
    """Runs in a worker process (`tool` None: nothing, the pool's warm-up)."""
    try:
        return None if tool is None else tool.execute(arguments)  # type: ignore[arg-type]
    finally:
        reap_exited_children()  # orphans of the tool's processes come to this subreaper


def _import(modules: list[str], started) -> None:
    keep_descendants()  # what a tool starts, daemons too, dies with this worker
    for name in modules:
        importlib.import_module(name)
    with started.get_lock():
        started.value += 1


def _check_picklable(tool: Tool) -> None:
    try:
        pickle.dumps(tool)
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same
        raise ValueError(
            f"tool {tool.name!r} ({type(tool).__name__}) cannot be sent to a worker process "
            f"({type(e).__name__}: {e}); keep only plain values on the tool and open clients "
            "or files inside `execute`"
        ) from e


def _done(result: ToolResult) -> concurrent.futures.Future[ToolResult]:
    f: concurrent.futures.Future[ToolResult] = concurrent.futures.Future()
    f.set_result(result)
    return f
