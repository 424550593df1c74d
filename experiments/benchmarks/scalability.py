"""Scalability: RL step time against batch size, response length and device count.

Three one-dimensional sweeps around a base point (batch `base_batch` prompts × rollout.n,
response `base_response_length` tokens, 1 device). Every point is a separate process running
the `throughput` benchmark (the device count of a JAX process is fixed when it starts), with
its own results folder under `<out_dir>/points/`. Responses run to their full length
(`rollout.ignore_eos`) so the length axis is exact.

On one CPU, "devices" are simulated (`jax_num_cpu_devices`) and share the same cores: that
sweep measures the cost of SPMD partitioning and collectives, not a speed-up.

Config keys (`scalability`): workload, batches ("2,4,8" prompts), response_lengths ("16,32,64"),
devices ("1,2,4,8"), base_batch, base_response_length, warmup, steps, timeout_s.
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


def point_overrides(batch: int, response_length: int, devices: int, n: int) -> dict:
    """Trainer keys for one point: `batch` prompts, one update over all `batch × n` responses
    per step, split evenly over `devices` data-parallel shards.

    Raises:
      ValueError: `batch × n` is not divisible by `devices`.
    """
    rows = batch * n
    if rows % devices:
        raise ValueError(f"{rows} responses per step do not split over {devices} devices")
    return {
        "data.train_batch_size": batch,
        "data.max_response_length": response_length,
        "actor_rollout_ref.rollout.response_length": response_length,
        "actor_rollout_ref.rollout.ignore_eos": True,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": rows // devices,
        "actor_rollout_ref.actor.ppo_mini_batch_size": batch,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": rows // devices,
        "critic.ppo_mini_batch_size": batch,
        "critic.ppo_micro_batch_size_per_gpu": rows // devices,
    }


def points(cfg) -> list[dict]:
    """The sweep's points (the base point once), each {batch, response_length, devices}."""
    base = dict(batch=cfg.base_batch, response_length=cfg.base_response_length, devices=1)
    out = [base]
    for key, values in (
        ("batch", cfg.batches),
        ("response_length", cfg.response_lengths),
        ("devices", cfg.devices),
    ):
        for v in _ints(values):
            p = base | {key: v}
            if p not in out:
                out.append(p)
    return out


def run_point(cfg, point: dict, n: int, root: pathlib.Path) -> dict:
    """Runs the throughput benchmark for one point in its own process; returns its summary."""
    overrides = point_overrides(point["batch"], point["response_length"], point["devices"], n)
    cmd = [
        sys.executable,
        "-m",
        "experiments.benchmarks.run",
        f"--config={ROOT / 'experiments' / 'configs' / 'bench_throughput.py'}",
        f"--config.results_root={root}",
        f"--config.throughput.workload={cfg.workload}",
        f"--config.throughput.warmup={cfg.warmup}",
        f"--config.throughput.steps={cfg.steps}",
        f"--config.throughput.devices={point['devices']}",
        f"--config.throughput.overrides={json.dumps(overrides)}",
    ]
    log.info("point %s", point)
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=cfg.timeout_s, check=False
    )
    if proc.returncode:
        raise RuntimeError(f"point {point} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    out_dir = pathlib.Path(proc.stdout.strip().splitlines()[-1])
    return json.loads((out_dir / "summary.json").read_text())


def run(cfg, out_dir: pathlib.Path) -> dict:
    from experiments.benchmarks.peers import build_workload

    n = build_workload(cfg.workload)["n"]
    rows = []
    for point in points(cfg):
        s = run_point(cfg, point, n, out_dir / "points")
        rows.append(
            point
            | {
                k: s[k]
                for k in (
                    "step_time_s",
                    "step_cpu_time_s",
                    "tokens_per_s",
                    "tokens_per_s_per_device",
                    "mfu_actor",
                    "mfu_step",
                    "dominant_stage",
                    "stages_s",
                )
            }
        )
        log.info("%s", json.dumps(rows[-1]))
    return {"workload": cfg.workload, "rollout_n": n, "points": rows}


def plot(summary: dict, out_dir: pathlib.Path) -> None:
    """Step time and tokens/s against each swept variable (`scalability.png`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["points"]
    base = rows[0]
    axes_keys = ("batch", "response_length", "devices")
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key in zip(axes, axes_keys, strict=True):
        others = [k for k in axes_keys if k != key]
        line = sorted(
            (r for r in rows if all(r[k] == base[k] for k in others)), key=lambda r: r[key]
        )
        xs = [r[key] for r in line]
        ax.plot(xs, [r["step_time_s"] for r in line], marker="o", color="C0")
        ax.set_xlabel(key.replace("_", " "))
        ax.set_ylabel("step time (s)", color="C0")
        twin = ax.twinx()
        twin.plot(xs, [r["tokens_per_s"] for r in line], marker="s", color="C1")
        twin.set_ylabel("tokens/s", color="C1")
    fig.tight_layout()
    fig.savefig(out_dir / "scalability.png", dpi=100)
    plt.close(fig)
