"""`python -m experiments.benchmarks.run --config=experiments/configs/bench_<name>.py [...]`

Runs one benchmark from a config and writes `results/YYYYMMDD_HHMMSS/`:
`config.json` (the config as run), `summary.json` (the numbers), `log.txt` (the detailed log)
and the benchmark's PNG plots.

A benchmark is a module of this package with `run(cfg, out_dir) -> dict` (the summary) and
`plot(summary, out_dir)`; `cfg.benchmark` names it and `cfg.<name>` holds its settings:
`throughput`, `scalability`, `algorithm`, `peers`, and `generation` / `reshard` where those
modules exist.
"""

from __future__ import annotations

import datetime
import importlib
import json
import logging
import pathlib
import sys

from absl import app
from ml_collections import config_flags

from experiments.benchmarks.requirements import MissingRequirement, require

BENCHMARKS = (
    "throughput",
    "scalability",
    "algorithm",
    "peers",
    "generation",
    "reshard",
    "placement",
    "memory",
    "integration",
    "batch_sweep",
)
_CONFIG = config_flags.DEFINE_config_file("config", None, "benchmark config file")
log = logging.getLogger("experiments.benchmarks")


def results_dir(root: str | pathlib.Path) -> pathlib.Path:
    """A new `root/YYYYMMDD_HHMMSS/` (UTC; a suffix when two runs start in the same second)."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d_%H%M%S")
    out = pathlib.Path(root) / stamp
    suffix = 1
    while out.exists():
        out = pathlib.Path(root) / f"{stamp}_{suffix}"
        suffix += 1
    out.mkdir(parents=True)
    return out


def run_benchmark(cfg) -> pathlib.Path:
    """Runs `cfg.benchmark`; returns the results folder.

    Raises:
      ValueError: `cfg.benchmark` is not a known benchmark (the message lists them).
      MissingRequirement: a library or peer environment it needs is missing (with the
        command that installs it).
    """
    if cfg.benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {cfg.benchmark!r}; known: {', '.join(BENCHMARKS)}")
    settings = cfg.get(cfg.benchmark, {})
    systems = tuple(s for s in settings.get("systems", "").split(",") if s)
    require(cfg.benchmark, systems)
    module = importlib.import_module(f"experiments.benchmarks.{cfg.benchmark}")
    out = results_dir(cfg.get("results_root", "results"))
    handler = logging.FileHandler(out / "log.txt")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    (out / "config.json").write_text(cfg.to_json_best_effort(indent=2))
    log.info("benchmark %s -> %s", cfg.benchmark, out)
    summary = module.run(cfg[cfg.benchmark], out)
    summary = {"benchmark": cfg.benchmark, **summary}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    module.plot(summary, out)
    logging.getLogger().removeHandler(handler)
    handler.close()
    log.info("wrote %s", out)
    return out


def main(argv: list[str]) -> None:
    del argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = _CONFIG.value
    devices = cfg[cfg.benchmark].get("devices", 0) if cfg.benchmark in cfg else 0
    if isinstance(devices, int) and devices:  # before JAX starts; scalability lists several
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", devices)
    try:
        print(run_benchmark(cfg))
    except MissingRequirement as err:
        sys.exit(str(err))


if __name__ == "__main__":
    app.run(main)
