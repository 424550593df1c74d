"""Running reward functions on rows: in threads (trusted built-ins) or isolated in worker
processes with a per-call timeout (user code).

A row's outcome is an `Outcome`: a finite score and its extra keys, or the kind of failure
(`error`: raised, called `sys.exit` or `os._exit` (named with its exit code), or returned
something other than a number or verl's dict with a numeric `score` (a string, None, a
list...); `crash`: the worker process died, e.g. `os.abort()` or a segfault; `timeout`: still
running after `timeout_s`; `nonfinite`: NaN or inf after conversion to float32, the training
dtype, or a magnitude above `MAX_ABS_SCORE`, whose square would overflow the float32 statistics
of the advantage).
Nothing a reward function does reaches the caller as an exception.

Worker processes come from a `forkserver` context (`hybridjax.process_tree.worker_context`;
JAX's threads make `fork` unsafe, `spawn` re-imports the trainer for every replacement) through
`pebble.ProcessPool`, which kills a worker whose call outlives its timeout and replaces any
worker that dies. Each worker loads the function once from its `FunctionSpec`; nothing the
function starts outlives the worker, a daemon that double-forks into a session of its own
included (`hybridjax.process_tree`). Rows travel as pickles, a cost per call far above the µs
of the built-in regex checks, which is why trusted built-ins stay on threads (measured by
experiments/benchmarks/reward_service.py; the numbers are in docs/benchmarks.md).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import numpy as np
import pebble

from hybridjax.process_tree import keep_descendants, reap_exited_children, worker_context
from hybridjax.rewards.registry import default_compute_score, load_custom_reward_function

FAILURES = ("error", "crash", "timeout", "nonfinite")
MAX_ABS_SCORE = 1e6  # a larger score is a bug (squares of 1e19 already overflow float32)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One row's result: `kind` is `ok` or one of `FAILURES`; `error` says what went wrong."""

    score: float = 0.0
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    kind: str = "ok"
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        if self.kind != "ok":
            return {"kind": self.kind, "error": self.error}
        extras = {k: _json_value(v) for k, v in self.extras.items()}
        return {"kind": "ok", "score": self.score, "extras": extras}

    @classmethod
    def from_json(cls, row: Any) -> Outcome:
        """A server's result row; a malformed one (not an object, an unknown kind, a score
        that is not a number in range) is an `error` / `nonfinite` outcome, never raised."""
        if not isinstance(row, dict):
            return cls(kind="error", error=f"malformed result row {str(row)[:80]!r}")
        kind = row.get("kind", "ok")
        if kind != "ok":
            known = kind in FAILURES
            return cls(kind=kind if known else "error", error=str(row.get("error", kind)))
        extras = row.get("extras") or {}
        outcome = normalize(row.get("score"))
        return dataclasses.replace(outcome, extras=dict(extras) if isinstance(extras, dict) else {})


def _json_value(v: Any) -> Any:
    """Extras as JSON values: numpy scalars to Python, non-finite floats to None."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v if isinstance(v, str | int | float | bool | type(None)) else str(v)


def normalize(value: Any) -> Outcome:
    """A reward function's return value (a number, or a dict with a numeric `score`) as an
    `Outcome`: `error` for anything else, `nonfinite` when the float32 score is NaN/inf or
    above `MAX_ABS_SCORE` in magnitude."""
    extras = {}
    try:
        if isinstance(value, dict):
            if "score" not in value:
                raise KeyError(f"reward dict has no 'score' key (keys: {sorted(value)})")
            extras = {k: v for k, v in value.items() if k != "score"}
            value = value["score"]
        score = _number(value)
    except Exception as e:
        return Outcome(kind="error", error=repr(e))
    with np.errstate(over="ignore"):
        score32 = float(np.float32(score))
    if not math.isfinite(score32):
        error = f"reward function returned {score}" + (
            " (inf in float32)" if math.isfinite(score) else ""
        )
        return Outcome(extras=extras, kind="nonfinite", error=error)
    if abs(score32) > MAX_ABS_SCORE:
        error = f"reward function returned {score}, beyond ±{MAX_ABS_SCORE:g}"
        return Outcome(extras=extras, kind="nonfinite", error=error)
    return Outcome(score32, extras)


def _number(value: Any) -> float:
    """`value` as a float when it is a real number (bools, numpy and 0-d array scalars too).

    Raises:
      TypeError: anything else, e.g. the string "1.0" (named with its type).
    """
    kind = getattr(getattr(value, "dtype", None), "kind", "")
    if isinstance(value, numbers.Real | np.bool_) or (getattr(value, "shape", None) == ()
                                                     and kind in "biuf" and kind):  # fmt: skip
        return float(value)
    shown = repr(value)[:60]
    raise TypeError(
        f"reward function returned {type(value).__name__} {shown}; expected a number or a "
        "dict with a numeric 'score'"
    )


@dataclasses.dataclass(frozen=True)
class FunctionSpec:
    """Where a reward function comes from, so that a worker process can load it itself:
    `path` empty = the built-in `default_compute_score`, else `custom_reward_function.*`."""

    path: str = ""
    name: str = "compute_score"
    kwargs: tuple[tuple[str, Any], ...] = ()

    def load(self) -> Callable[..., Any]:
        if not self.path:
            return default_compute_score
        return load_custom_reward_function(self.path, self.name, dict(self.kwargs))


def check_signature(fn: Callable[..., Any], batched: bool, where: str) -> None:
    """Raises TypeError when `fn` cannot take verl's arguments: per row
    `(data_source, solution_str, ground_truth, extra_info)`, or for `reward_manager=batch`
    keywords `data_sources, solution_strs, ground_truths, extra_infos`."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have none; their first call will tell
        return
    try:
        if batched:
            signature.bind(data_sources=[], solution_strs=[], ground_truths=[], extra_infos=[])
        else:
            signature.bind("data_source", "solution_str", "ground_truth", None)
    except TypeError as e:
        expected = (
            "fn(data_sources, solution_strs, ground_truths, extra_infos, **kwargs) -> list"
            if batched
            else "fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict"
        )
        raise TypeError(f"reward function {where} has signature {signature}: {e}; "
                        f"expected {expected}") from e  # fmt: skip


Row = tuple[str, str, Any, Any]  # (data_source, solution_str, ground_truth, extra_info)


def call_rows(fn: Callable[..., Any], rows: Sequence[Row], batched: bool) -> list[Outcome]:
    """Scores `rows` in this process: one call per row, or one call for all of them
    (`batched`, verl's `BatchRewardManager` contract). Never raises."""
    if not batched:
        return [_call_one(fn, row) for row in rows]
    try:
        values = fn(
            data_sources=[r[0] for r in rows],
            solution_strs=[r[1] for r in rows],
            ground_truths=[r[2] for r in rows],
            extra_infos=[r[3] for r in rows],
        )
        values = list(values)
        if len(values) != len(rows):
            raise ValueError(f"batch reward function returned {len(values)} scores for "
                             f"{len(rows)} rows")  # fmt: skip
    except BaseException as e:  # SystemExit too: the row fails, the run goes on
        return [Outcome(kind="error", error=repr(e))] * len(rows)
    return [normalize(v) for v in values]


def _call_one(fn: Callable[..., Any], row: Row) -> Outcome:
    try:
        return normalize(fn(*row))
    except BaseException as e:  # SystemExit too: the row fails, the run goes on
        return Outcome(kind="error", error=repr(e))


_WORKER_FN: Callable[..., Any] | None = None  # the function, loaded once per worker process


class WorkerExit(BaseException):
    """A reward function called `os._exit` in its worker process (see `_os_exit_raises`)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code

    def __repr__(self) -> str:
        return f"reward function called os._exit({self.code}) (exit code {self.code})"


@contextlib.contextmanager
def _os_exit_raises() -> Iterator[None]:
    """While a reward function runs in its worker process, `os._exit` there raises
    `WorkerExit` (its row fails, naming the exit code): a worker leaving with code 0 mid-call
    looks to the pool like a normal exit, and the call would be reported only when its timeout
    ran out. Processes the function starts, and the worker's own exit, keep the real one."""
    real, worker = os._exit, os.getpid()

    def _exit(status: int) -> NoReturn:
        if os.getpid() != worker:
            real(status)
        raise WorkerExit(status)

    os._exit = _exit
    try:
        yield
    finally:
        os._exit = real


def _load_in_worker(spec: FunctionSpec) -> None:
    global _WORKER_FN
    keep_descendants()  # what the function starts, daemons too, dies with this worker
    _WORKER_FN = spec.load()


def _call_in_worker(rows: list[Row], batched: bool) -> list[Outcome]:
    assert _WORKER_FN is not None, "the worker's initializer loads the function"
    try:
        with _os_exit_raises():
            return call_rows(_WORKER_FN, rows, batched)
    finally:
        reap_exited_children()  # orphans of the function's processes come to this subreaper


def quiet_bootstrap_errors(kind, value, tb) -> None:
    """`sys.excepthook` of the workers' forkserver (installed by
    `hybridjax.rewards.forkserver_preload`, so only there): a worker that was still starting
    when its pool was shut down finds the pool's semaphores gone (`FileNotFoundError` in
    `multiprocessing.synchronize`) and leaves with nothing to do; its traceback would print
    before the trainer's own message. Every other error keeps its traceback."""
    last = tb
    while last is not None and last.tb_next is not None:
        last = last.tb_next
    where = last.tb_frame.f_code.co_filename if last is not None else ""
    gone = os.path.join("multiprocessing", "synchronize.py")
    if isinstance(value, FileNotFoundError) and where.endswith(gone):
        return
    sys.__excepthook__(kind, value, tb)


class RowScorer:
    """Scores rows with one reward function, in threads or in worker processes.

    Args:
      fn: the function itself (thread path), or None to load `spec` in each worker process.
      spec: where worker processes load the function from (process path).
      num_workers: threads or processes.
      timeout_s: per call, process path only (a thread cannot be stopped).
      batched: one call per chunk of rows (`reward_model.reward_manager=batch`).
    """

    def __init__(
        self,
        fn: Callable[..., Any] | None,
        spec: FunctionSpec,
        num_workers: int,
        timeout_s: float,
        batched: bool = False,
    ):
        self.fn, self.timeout_s, self.batched = fn, timeout_s, batched
        self.num_workers = num_workers
        if fn is not None:
            self._pool: Any = concurrent.futures.ThreadPoolExecutor(num_workers, "reward")
        else:
            self._pool = pebble.ProcessPool(
                max_workers=num_workers,
                initializer=_load_in_worker,
                initargs=(spec,),
                context=worker_context(),
            )

    @property
    def isolated(self) -> bool:
        return self.fn is None

    def score(self, rows: Sequence[Row]) -> list[Outcome]:
        """Outcomes of `rows` in order (blocks; at most ⌈calls / num_workers⌉ · timeout_s)."""
        rows = list(rows)
        if not rows:
            return []
        chunks = [rows] if self.batched else [[r] for r in rows]
        futures = [self._submit(chunk) for chunk in chunks]
        out: list[Outcome] = []
        for chunk, future in zip(chunks, futures, strict=True):
            out += self._result(future, len(chunk))
        return out

    def _submit(self, chunk: list[Row]):
        if self.fn is not None:
            return self._pool.submit(call_rows, self.fn, chunk, self.batched)
        return self._pool.schedule(
            _call_in_worker, (chunk, self.batched), timeout=self.timeout_s or None
        )

    def _result(self, future, n: int) -> list[Outcome]:
        try:
            return future.result()
        except concurrent.futures.TimeoutError:
            failure = Outcome(kind="timeout", error=f"no result within {self.timeout_s} s")
        except pebble.ProcessExpired as e:
            failure = Outcome(kind="crash", error=f"worker process died (exit code {e.exitcode})")
        except BaseException as e:  # e.g. an unpicklable return value
            failure = Outcome(kind="error", error=repr(e))
        return [failure] * n

    def close(self) -> None:
        """Stops the workers at once (a hanging call is killed, not waited for)."""
        if self.fn is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        else:
            self._pool.stop()
            self._pool.join()
