"""What every trainer benchmark records beside its summary: per-stage timestamps, a profile.

* `StageClock` collects the `stage <name> <start> <end>` lines `hybridjax.trainer.pipeline.timed`
  logs at DEBUG level, so each step's log entry can carry when each stage ran.
* `profile_step` runs one step under the JAX profiler (`trace/`, open it with TensorBoard's
  profile plugin or Perfetto) and under cProfile, and draws the host time of that step as a
  flame graph (`host_profile.svg`, with `flameprof` from the `bench` extra; the raw
  `host_profile.pstats` is always written).
* `stability` summarises step times: min / median / p95 / max / std (seed 000's figures).
"""

from __future__ import annotations

import cProfile
import logging
import pathlib
import pstats
import statistics

import numpy as np

STEP_LOGGER = "hybridjax.trainer.pipeline"


class StageClock(logging.Handler):
    """Records (stage, start, end) from the step's DEBUG log while attached (a context)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.events: list[tuple[str, float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("stage "):
            name, start, end = record.args
            self.events.append((name, float(start), float(end)))

    def take(self, origin: float) -> list[dict]:
        """The events since the last call, as seconds after `origin`; clears them."""
        out = [
            {"stage": n, "start_s": round(s - origin, 6), "end_s": round(e - origin, 6)}
            for n, s, e in self.events
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


def profile_step(fn, out_dir: pathlib.Path):
    """Runs `fn()` under the JAX profiler (`out_dir/trace`) and cProfile; writes
    `host_profile.pstats` and, with flameprof installed, `host_profile.svg`. Returns fn()."""
    import jax

    profiler = cProfile.Profile()
    with jax.profiler.trace(str(out_dir / "trace")):
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
