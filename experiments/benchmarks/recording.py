"""What every trainer benchmark records beside its summary: per-stage timestamps, a profile.

* `StageClock` collects the `stage <name> <start> <end>` lines `hybridjax.rl.pipeline.timed`
  logs at DEBUG level, so each step's log entry can carry when each stage ran.
* `profile_step` runs one step under the JAX profiler (`trace/`, open it with TensorBoard's
  profile plugin or Perfetto; `trace/**/perfetto_trace.json.gz` is the same trace as Chrome
  trace-event JSON) and under cProfile, and draws the host time of that step as a flame graph
  (`host_profile.svg`, with `flameprof` from the `bench` extra; the raw `host_profile.pstats`
  is always written).
* `collective_time_s` sums the durations of the collective instructions of a profiled step's
  trace (`trace_events` reads it) per kind and per stage span.
* `StageMemory` (with `StageClock`) adds each stage's peak memory to its record: the device's
  `peak_bytes_in_use` / `bytes_in_use` where the backend reports them (GPU, TPU), else (CPU)
  the process's peak resident set since the previous stage ended (VmHWM, reset through
  `/proc/self/clear_refs` at each stage's end).
* `CompiledStages` compiles each jitted device stage of `hybridjax.rl.step` once more for
  the arguments it is called with and keeps XLA's memory analysis (arguments, outputs,
  donated, scratch per device) and the collectives of the partitioned program
  (`collective_bytes`: the result bytes of every all-reduce, all-gather, reduce-scatter,
  all-to-all and collective-permute per device, each instruction counted once, also when it
  sits in a loop body that runs several times).
* `stability` summarises step times: min / median / p95 / max / std (seed 000's figures).
"""

from __future__ import annotations

import contextlib
import cProfile
import gzip
import json
import logging
import math
import pathlib
import pstats
import re
import statistics
from collections.abc import Iterable

import numpy as np

STEP_LOGGER = "hybridjax.rl.pipeline"


class StageClock(logging.Handler):
    """Records (stage, start, end) from the step's DEBUG log while attached (a context)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.events: list[tuple[str, float, float, dict]] = []
        self.memory = StageMemory()

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("stage "):
            name, start, end = record.args
            self.events.append((name, float(start), float(end), self.memory.sample()))

    def take(self, origin: float) -> list[dict]:
        """The events since the last call, as seconds after `origin`, each with its memory
        (`StageMemory.sample`); clears them."""
        out = [
            {"stage": n, "start_s": round(s - origin, 6), "end_s": round(e - origin, 6), **mem}
            for n, s, e, mem in self.events
        ]
        self.events = []
        return out

    def __enter__(self) -> StageClock:
        logger = logging.getLogger(STEP_LOGGER)
        self._level = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger(STEP_LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self._level)


class StageMemory:
    """Peak memory per stage (see the module docstring); `sample()` at each stage's end."""

    def __init__(self):
        self._reset()

    @staticmethod
    def _reset() -> None:
        with contextlib.suppress(OSError):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM back to the current resident set

    def sample(self) -> dict[str, int]:
        import jax

        stats = jax.local_devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            return {
                "device_peak_bytes": int(stats["peak_bytes_in_use"]),
                "device_bytes_in_use": int(stats.get("bytes_in_use", 0)),
            }
        out = {}
        with contextlib.suppress(OSError), open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    out["host_peak_rss_bytes"] = int(line.split()[1]) * 1024
        self._reset()
        return out


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_DTYPE_BYTES |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_INSTRUCTION = re.compile(
    r"=\s*(\(?[a-z0-9]+\[[^=]*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\("
)
_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


_COLLECTIVE_EVENT = re.compile(r"(" + "|".join(COLLECTIVES) + r")(-start|-done)?(\.\d+)?")


def collective_time_s(
    events: list[dict], stages: Iterable[str], devices: int
) -> dict[str, dict[str, float]]:
    """Seconds per device spent in each kind of collective, per stage span, of a profiled step.

    Args:
      events: Chrome trace events (`trace_events`): dicts with `ph`, `name`, `ts` and `dur`
        (microseconds). The runtime names each executed HLO instruction's event after it
        (`all-reduce.3`; asynchronous pairs `all-gather-start.1` / `all-gather-done.1` both
        count); other events are ignored.
      stages: names of the stage spans (`hybridjax.rl.pipeline.timed` ranges: `gen`,
        `reshard`, `update_actor`, `step`, ...).
      devices: how many devices ran the step; each runs its own copy of every collective.

    Returns:
      `{stage: {kind: seconds}}` for each stage with a span in `events`: the summed durations
      of the collective events that start inside one of the stage's spans, divided by
      `devices`; `kind` runs over `COLLECTIVES`. Spans nest (`step` holds every stage), so
      `step` is the whole step's figure. On the CPU runtime a collective's event includes the
      wait for the slowest device to reach it.
    """
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("name") in stages:
            spans.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))
    out = {name: dict.fromkeys(COLLECTIVES, 0.0) for name in spans}
    for e in events:
        m = _COLLECTIVE_EVENT.fullmatch(e.get("name", ""))
        if e.get("ph") != "X" or m is None:
            continue
        for name, ranges in spans.items():
            if any(start <= e["ts"] <= end for start, end in ranges):
                out[name][m.group(1)] += e["dur"] * 1e-6 / devices
    return out


def trace_events(trace_dir: pathlib.Path) -> list[dict]:
    """The events of the newest `perfetto_trace.json.gz` under `trace_dir` (written by
    `profile_step`; Chrome trace-event JSON, times in microseconds).

    Raises:
      FileNotFoundError: no such file under `trace_dir`.
    """
    found = sorted(pathlib.Path(trace_dir).rglob("perfetto_trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(found[-1], "rt") as f:
        return json.load(f)["traceEvents"]


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Result bytes per device of each kind of collective in an optimised, partitioned HLO
    module (`compiled.as_text()`), summed over its instructions (async `-start` ops once)."""
    out = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.search(_COMMENT.sub("", line))  # tuples of 6+: `/*index=5*/`
        if m is None:
            continue
        arrays = _ARRAY.findall(m.group(1))
        if m.group(3) and m.group(2) in ("all-gather", "collective-permute"):
            arrays = arrays[-1:]  # an async start's tuple holds (operand, result)
        for dtype, dims in arrays:
            shape = [int(d) for d in dims.split(",") if d]
            out[m.group(2)] += math.prod(shape) * _DTYPE_BYTES.get(dtype, 4)
    return out


# jitted function of `hybridjax.rl.step` → the stage it runs in
STEP_JITS = {
    "_old_log_prob": "old_log_prob",
    "_ref_log_prob": "ref",
    "_values": "values",
    "_update_critic": "update_critic",
    "_update_actor": "update_actor",
}


class CompiledStages:
    """While entered, the jitted device stages of `hybridjax.rl.step` are compiled once
    more per new argument signature (before the call: the update donates its state) and
    `self.stages[name]` keeps XLA's memory analysis and `collective_bytes` (bytes per device).
    Costs one extra compile per stage."""

    def __init__(self):
        self.stages: dict[str, dict] = {}
        self._seen: set = set()

    def _wrap(self, name: str, fn):
        def call(*args):
            key = (name, str(jax_shapes(args)))
            if key not in self._seen:
                self._seen.add(key)
                compiled = fn.lower(*args).compile()
                m = compiled.memory_analysis()
                self.stages[STEP_JITS[name]] = {
                    "argument_bytes": m.argument_size_in_bytes,
                    "output_bytes": m.output_size_in_bytes,
                    "donated_bytes": m.alias_size_in_bytes,
                    "scratch_bytes": m.temp_size_in_bytes,
                    "collective_bytes": collective_bytes(compiled.as_text()),
                }
            return fn(*args)

        return call

    def annotate(self, events: list[dict], metrics: dict) -> list[dict]:
        """`StageClock.take` events with their stage's compiled figures (`compiled`), and the
        re-layout's bytes (`perf/reshard_bytes` of the step's `metrics`) on `reshard`."""
        out = []
        for e in events:
            e = dict(e)
            if e["stage"] in self.stages:
                e["compiled"] = self.stages[e["stage"]]
            if e["stage"] == "reshard" and "perf/reshard_bytes" in metrics:
                e["reshard_bytes"] = metrics["perf/reshard_bytes"]
            out.append(e)
        return out

    def __enter__(self) -> CompiledStages:
        from hybridjax.rl import step

        self._saved = {n: getattr(step, n) for n in STEP_JITS}
        for n, fn in self._saved.items():
            setattr(step, n, self._wrap(n, fn))
        return self

    def __exit__(self, *exc) -> None:
        from hybridjax.rl import step

        for n, fn in self._saved.items():
            setattr(step, n, fn)


def jax_shapes(tree) -> list:
    """(shape, dtype) of every array leaf, the rest by type: a jit cache key of sorts."""
    import jax

    leaf = lambda x: (getattr(x, "shape", None), str(getattr(x, "dtype", type(x).__name__)))
    return [leaf(x) for x in jax.tree.leaves(tree)]


def profile_step(fn, out_dir: pathlib.Path):
    """Runs `fn()` under the JAX profiler (`out_dir/trace`, with `perfetto_trace.json.gz`) and
    cProfile; writes `host_profile.pstats` and, with flameprof installed, `host_profile.svg`.
    Returns fn()."""
    import jax

    profiler = cProfile.Profile()
    with jax.profiler.trace(str(out_dir / "trace"), create_perfetto_trace=True):
        profiler.enable()
        try:
            result = fn()
        finally:
            profiler.disable()
    stats = pstats.Stats(profiler)
    stats.dump_stats(out_dir / "host_profile.pstats")
    try:
        import flameprof
    except ModuleNotFoundError:
        logging.getLogger(__name__).warning(
            "no flame graph: flameprof is missing; pip install -e '.[bench]'"
        )
        return result
    with open(out_dir / "host_profile.svg", "w") as out:
        flameprof.render(stats.stats, out)
    return result


def stability(times_s: list[float]) -> dict[str, float]:
    """min, median, p95 (linear interpolation), max, std (population) and mean of step times."""
    x = np.asarray(times_s, np.float64)
    return {
        "steps": len(times_s),
        "min_s": float(x.min()),
        "median_s": float(statistics.median(times_s)),
        "p95_s": float(np.percentile(x, 95)),
        "max_s": float(x.max()),
        "std_s": float(x.std()),
        "mean_s": float(x.mean()),
    }
