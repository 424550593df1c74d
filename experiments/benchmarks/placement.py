"""Placement and asynchrony: `sync` on one co-located pool against `one_step_off` with the
rollout on its own pool, on the same trainer config and device count, plus `sync_split` (`sync`
on the split pools), which separates the gain of the overlap from that of the placement.

Each mode runs `warmup + steps` RL steps of `RLTrainer`; reported per mode: steps/hour, tokens/s
(the medians of the timed steps' `timing_s/step` and `perf/total_num_tokens`), the stage times,
`timing_s/wait_rollout|wait_update`, `async/staleness_*`, and a timeline of every step: the
generation of each batch, its reward scoring (submit to scores done: rule functions on host
threads, a reward model on its pool) and the training of each step on the wall clock
(`timeline.png`, one row per pool and one for scoring), which shows what overlaps. With a
rollout ahead, batch k+1 is scored on the rollout thread as soon as it is generated, while
step k trains. The split run puts the rollout on
`rollout_devices` devices and training (actor, reference, critic, reward model) on the rest.

On a CPU host every simulated device shares the same cores, so overlap gains at most what the
cores leave idle; the numbers are what the host measured. The same config runs unchanged on a
GPU machine (`devices=0`: the platform's devices).

Config keys (`placement`): workload (a peer workload, `experiments/peers/workload.py`: "a", "b"
(102M), "qs", "tiny"; "" = use trainer_config), trainer_config (a trainer config file, default
the quick start), overrides (JSON object of dotted trainer keys → values), modes (comma-separated
subset of `MODES`; "" = all), rollout_devices, warmup, steps, devices (simulated CPU devices,
applied by `run.py` before JAX starts; 0 = the platform's).
"""

from __future__ import annotations

import json
import logging
import pathlib
import statistics
import time

from experiments.benchmarks.throughput import load_trainer_config, workload_trainer_config

log = logging.getLogger(__name__)
# run name -> (trainer.rollout_mode, rollout on its own pool). `sync_split` is the control: the
# same pools as `one_step_off` without the overlap, so the two differ only by the overlap.
MODES = {
    "sync": ("sync", False),
    "sync_split": ("sync", True),
    "one_step_off": ("one_step_off", True),
}


def _trainer_config(cfg, name: str, out_dir: pathlib.Path, n_devices: int):
    if cfg.get("workload"):
        c, _ = workload_trainer_config(cfg.workload)
        c.data.val_files = ""  # the benchmark does not validate
    else:
        c = load_trainer_config(cfg.trainer_config)
    c.update_from_flattened_dict(json.loads(cfg.overrides or "{}"))
    t = c.trainer
    mode, split = MODES[name]
    t.default_local_dir = str(out_dir / name / "checkpoints")
    t.logger, t.progress_bar, t.resume_mode = (), False, "disable"
    t.val_before_train, t.test_freq, t.save_freq = False, -1, -1
    t.total_training_steps = cfg.warmup + cfg.steps
    if split:  # training keeps global_pool, so every other role stays with it
        rest = n_devices - cfg.rollout_devices
        c.resource_pool = dict(
            global_pool=dict(n_devices=rest), rollout_pool=dict(n_devices=cfg.rollout_devices)
        )
        c.placement.rollout = "rollout_pool"
        t.rollout_mode = mode
    return c


def _run_mode(cfg, name: str, out_dir: pathlib.Path, n_devices: int) -> dict:
    from hybridjax.rl.trainer import RLTrainer

    trainer = RLTrainer(_trainer_config(cfg, name, out_dir, n_devices))
    steps, spans = [], []
    origin = time.perf_counter()
    try:
        for n in range(1, cfg.warmup + cfg.steps + 1):
            start = time.perf_counter()
            metrics = trainer.train_step(n)
            end = time.perf_counter()
            steps.append(metrics)
            wait = metrics.get("timing_s/wait_rollout", 0.0)
            if trainer.rollout_ahead is None:  # generation, then training
                gen = metrics["timing_s/gen"]
                rows = ("all devices",) * 2 if name == "sync" else ("rollout pool", "training pool")
                spans.append((rows[0], "gen", n, start, start + gen))
                spans.append((rows[1], "train", n, start + gen, end))
            else:
                spans.append(("training pool", "train", n, start + wait, end))
            log.info("%s step %d: %s", name, n, json.dumps(metrics))
        if trainer.rollout_ahead is not None:
            for _, n, start, end in trainer.rollout_ahead.events:
                spans.append(("rollout pool", "gen", n, start, end))
        for _, n, start, end in trainer.reward.events:  # rule functions (+ reward model)
            spans.append(("reward scoring", "reward", n, start, end))
    finally:
        trainer.close()
    timed = steps[cfg.warmup :]
    med = lambda key: statistics.median(m.get(key, 0.0) for m in timed)
    step_s, tokens = med("timing_s/step"), med("perf/total_num_tokens")
    keys = sorted({k for m in timed for k in m if k.startswith(("timing_s/", "async/"))})
    return {
        "rollout_mode": MODES[name][0],
        "placement": {p.name: len(p.devices) for p in trainer.placement.pools},
        "step_time_s": step_s,
        "steps_per_hour": 3600.0 / step_s,
        "tokens_per_s": tokens / step_s,
        "medians": {k: med(k) for k in keys},
        "timeline": [
            dict(row=row, stage=stage, step=n, start=s - origin, end=e - origin)
            for row, stage, n, s, e in spans
        ],
    }


def run(cfg, out_dir: pathlib.Path) -> dict:
    import jax

    n_devices = jax.device_count()
    if not 0 < cfg.rollout_devices < n_devices:
        raise ValueError(
            f"placement.rollout_devices ({cfg.rollout_devices}) must leave devices for training "
            f"(of {n_devices})"
        )
    names = [m.strip() for m in cfg.get("modes", "").split(",") if m.strip()] or list(MODES)
    unknown = sorted(set(names) - set(MODES))
    if unknown:
        raise ValueError(f"placement.modes: unknown {unknown} (valid: {list(MODES)})")
    runs = {name: _run_mode(cfg, name, out_dir, n_devices) for name in names}
    rate = lambda name: runs[name]["steps_per_hour"]
    summary = {
        "devices": n_devices,
        "warmup": cfg.warmup,
        "steps": cfg.steps,
        "workload": cfg.get("workload", ""),
        "trainer_config": "" if cfg.get("workload") else cfg.trainer_config,
        "host_cpus": _cpus(),
        "runs": runs,
    }
    for key, (fast, slow) in {
        "speedup_one_step_off": ("one_step_off", "sync"),
        "speedup_of_the_overlap": ("one_step_off", "sync_split"),
    }.items():
        if fast in runs and slow in runs:
            summary[key] = rate(fast) / rate(slow)
    return summary


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def plot(summary: dict, out_dir: pathlib.Path) -> None:
    """`timeline.png`: per mode, one row per pool, a bar per generation / training span of the
    timed steps (from the first timed step's start; the warmup's compiles would dwarf them; a
    batch generated during the warmup is left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = summary["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 1.6 + 1.2 * len(runs)), sharex=True)
    colors = {"gen": "C1", "train": "C0", "reward": "C2"}
    for ax, (mode, run) in zip(axes, runs.items(), strict=True):
        timed = [s for s in run["timeline"] if s["step"] > summary["warmup"]]
        origin = min(s["start"] for s in timed if s["stage"] == "train")
        timed = [s for s in timed if s["end"] > origin - 2.0]  # not made during the warmup
        rows = sorted({s["row"] for s in timed})
        for span in timed:
            y, start = rows.index(span["row"]), span["start"] - origin
            width, color = span["end"] - span["start"], colors[span["stage"]]
            ax.barh(y, width, left=start, color=color, edgecolor="white")
            ax.text(start, y, f" {span['stage'][0]}{span['step']}", va="center", fontsize=7)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_title(
            f"{mode}: {run['steps_per_hour']:.0f} steps/h, {run['tokens_per_s']:.0f} tokens/s",
            fontsize=9,
        )
    axes[-1].set_xlabel(
        "seconds from the first timed step (g = generation of batch k, r = its scoring, "
        "t = training step k)"
    )
    fig.tight_layout()
    fig.savefig(out_dir / "timeline.png", dpi=100)
    plt.close(fig)
