"""Rollout batch-size sweep (seed 000's figure): steps/hour against the rollout batch, and the
batch where device memory runs out.

For each `data.train_batch_size` in `batches` (prompts; × rollout.n responses):
* planned: `python -m hybridjax.plan --noxla` of `plan_config` at that batch on `devices`
  devices of `device_memory_gb` (peak per device, the stage that needs it, fits or not), in
  its own process (simulated CPU devices);
* measured (`measure`): the `throughput` benchmark of `trainer_config` at that batch (steps/hour,
  tokens/s, peak host memory), one process per point, each with its results under
  `<out_dir>/points/`. On this CPU only small batches of a small model are affordable, so the
  measured and planned sweeps may use different configs.

Where memory runs out: the first planned batch whose peak per device exceeds
`device_memory_gb`, the planner's verdict (`trainer.check_memory` refuses that config before
it starts). On this CPU nothing runs out for real (the host has no device memory limit), so
the measured points report the process's peak resident set per stage beside the plan instead
(`stage_peak_memory_bytes`, which includes the runtime's own hundreds of MB). Micro-batches
bound activations, so the batch adds only its own columns and the rollout's bookkeeping: the
plan grows slowly and linearly with it (`bytes_per_prompt` in the summary).

The measured points set `actor.ppo_mini_batch_size` to the batch (one on-policy update per
step, as the quick start); the planned ones keep the config's mini-batch (verl's recipes fix it
and take more optimizer steps per batch). Config keys (`batch_sweep`): trainer_config,
plan_config, plan_overrides (JSON), batches, plan_batches ("" = batches), devices,
device_memory_gb, measure, warmup, steps, timeout_s.
"""

from __future__ import annotations

import json
import logging
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
log = logging.getLogger(__name__)


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x]


def batch_overrides(batch: int, same_mini_batch: bool) -> dict:
    """Trainer keys of one point (`same_mini_batch`: one optimizer step per batch)."""
    out = {"data.train_batch_size": batch}
    if same_mini_batch:
        out["actor_rollout_ref.actor.ppo_mini_batch_size"] = batch
    return out


def _run(cmd: list[str], timeout: int) -> subprocess.CompletedProcess:
    log.info("running %s", " ".join(cmd))
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def plan_point(cfg, batch: int, out: pathlib.Path) -> dict:
    """The memory plan at `batch` (see the module docstring)."""
    overrides = json.loads(cfg.plan_overrides or "{}") | batch_overrides(batch, False)
    path = out / f"plan_{batch}.json"
    cmd = [sys.executable, "-m", "hybridjax.plan", f"--config={cfg.plan_config}"]
    cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
    cmd += [f"--devices={cfg.devices}", f"--device_memory_gb={cfg.device_memory_gb}"]
    cmd += ["--noxla"]  # the counted plan; XLA's CPU reference is not needed for a verdict
    done = _run([*cmd, f"--json={path}"], cfg.timeout_s)
    if not path.is_file():  # exit 1 = does not fit, with the JSON written; else it failed
        raise RuntimeError(f"plan at batch {batch} failed:\n{done.stderr[-3000:]}")
    plan = json.loads(path.read_text())
    worst = plan["stages"][plan["worst_stage"]]
    return {"fits": plan["fits"], "peak_bytes": worst["peak_bytes"], "stage": plan["worst_stage"]}


def measure_point(cfg, batch: int, out: pathlib.Path) -> dict:
    """steps/hour etc. of the throughput benchmark at `batch`."""
    overrides = batch_overrides(batch, True)
    cmd = [sys.executable, "-m", "experiments.benchmarks.run"]
    cmd += [
        f"--config={ROOT / 'experiments' / 'configs' / 'bench_throughput.py'}",
        f"--config.results_root={out}",
    ]
    cmd += [
        "--config.throughput.workload=",
        f"--config.throughput.trainer_config={cfg.trainer_config}",
    ]
    cmd += [f"--config.throughput.overrides={json.dumps(overrides)}"]
    cmd += [f"--config.throughput.warmup={cfg.warmup}", f"--config.throughput.steps={cfg.steps}"]
    cmd += ["--config.throughput.profile=False"]
    done = _run(cmd, cfg.timeout_s)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    folder = pathlib.Path(done.stdout.strip().splitlines()[-1])
    s = json.loads((folder / "summary.json").read_text())
    keys = ("steps_per_hour", "step_time_s", "tokens_per_s", "peak_memory_bytes")
    keys += ("stage_peak_memory_bytes",)
    return {k: s[k] for k in keys} | {"results": str(folder)}


def run(cfg, out_dir: pathlib.Path) -> dict:
    points = out_dir / "points"
    points.mkdir()
    planned = {b: plan_point(cfg, b, points) for b in _ints(cfg.plan_batches or cfg.batches)}
    measured = {b: measure_point(cfg, b, points) for b in _ints(cfg.batches)} if cfg.measure else {}
    too_big = [b for b, p in planned.items() if not p["fits"]]
    (b0, p0), (b1, p1) = sorted(planned.items())[0], sorted(planned.items())[-1]
    slope = (p1["peak_bytes"] - p0["peak_bytes"]) / (b1 - b0) if b1 > b0 else None
    return {
        "planned": planned,
        "bytes_per_prompt": slope,  # growth of the planned peak per device, per prompt
        "measured": measured,
        "first_batch_out_of_memory": min(too_big) if too_big else None,
        "devices": cfg.devices,
        "device_memory_gb": cfg.device_memory_gb,
    }


def plot(summary: dict, out_dir: pathlib.Path) -> None:
    """Measured steps/hour and planned peak GB against the batch (`batch_sweep.png`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    m = {int(k): v for k, v in summary["measured"].items() if "steps_per_hour" in v}
    a.plot(list(m), [v["steps_per_hour"] for v in m.values()], marker="o")
    a.set_xlabel("rollout batch (prompts)")
    a.set_ylabel("steps/hour (measured)")
    p = {int(k): v for k, v in summary["planned"].items()}
    b.plot(list(p), [v["peak_bytes"] / 1e9 for v in p.values()], marker="o")
    b.axhline(summary["device_memory_gb"], color="red", linewidth=0.8)
    b.set_xlabel("rollout batch (prompts)")
    b.set_ylabel("planned peak GB per device")
    fig.tight_layout()
    fig.savefig(out_dir / "batch_sweep.png", dpi=100)
    plt.close(fig)
