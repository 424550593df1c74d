"""Throughput of the full RL step: steps/hour, tokens/s, per-stage timing, MFU.

Runs `warmup + steps` steps of `hybridjax.rl.RLTrainer` on a peer workload
(`experiments/peers/workload.py`: `a`, `b` or the test-sized `tiny`) or on a trainer config
file, after measuring the peak matmul FLOP/s of the machine in the same process. MFU:

  actor update  training FLOPs (6·N·tokens + attention, `hybridjax.metrics.flops`) × ppo_epochs
                / (timing_s/update_actor · devices · peak)
  whole step    FLOPs of every model pass of the step / (timing_s/step · devices · peak), where
                a forward pass costs a third of a training pass and generation counts as one
                forward over prompt + response tokens (a KV cache saves recomputation, not
                these FLOPs): actor update + forward passes of rollout, old log-prob (unless
                the update is on-policy and the pass is skipped), reference (when a KL term is
                on) and critic values + critic update (when a critic is on).

Stage times are those the step reported: an on-policy step has no `old_log_prob` entry
(`summary.json`'s `old_log_prob_pass` says whether the pass ran).

Config keys (`throughput`): workload ("a", "b", "tiny"; "" = use trainer_config),
trainer_config (path of a trainer config file), overrides (JSON object of dotted trainer keys →
values, e.g. '{"data.train_batch_size": 4}'),
warmup, steps, profile (run the last step under the JAX profiler and cProfile: `trace/`,
`host_profile.svg`). `devices` (simulated CPU devices) is applied by `run.py` before JAX starts.

Besides `summary.json` (which adds `stability`: min/median/p95/max/std of the timed steps,
`communication`: bytes and seconds of the re-layout, collective bytes per stage and, for the
profiled step, collective seconds per stage and kind; and `peak_memory_bytes`), the run writes
`steps.jsonl`: every step's metrics with `bench/stages`, when each stage started and ended,
its peak memory (`recording.StageMemory`), for the jitted device stages XLA's memory analysis
and collective bytes per device (`compiled`, `recording.CompiledStages`), and the re-layout's
bytes on `reshard` (its time is the stage's).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import pathlib
import statistics
import tempfile
import time

import numpy as np

log = logging.getLogger(__name__)


def load_trainer_config(path: str):
    """`get_config()` of a trainer config file (e.g. `configs/tiny.py`)."""
    spec = importlib.util.spec_from_file_location("bench_trainer_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def workload_trainer_config(name: str):
    """The trainer config of peer workload `name` (built first if needed), over all devices;
    validation (when asked for) runs on the workload's own prompts."""
    import jax

    from experiments.benchmarks.peers import build_workload
    from experiments.peers.run_hybridjax import trainer_config

    spec = build_workload(name)
    cfg = trainer_config(spec, tempfile.mkdtemp(prefix="hybridjax_bench_"), jax.device_count())
    cfg.data.val_files = spec["train_files"]
    return cfg, spec


def step_flops(
    actor,
    critic,
    seq_lens: np.ndarray,
    ppo_epochs: int,
    use_ref: bool,
    old_log_prob: bool = True,
) -> float:
    """FLOPs of every model pass of one RL step (see the module docstring).

    Args:
      actor: the actor's ModelConfig; critic: the critic's, or None without a critic.
      seq_lens: (B,) prompt + response tokens of each sequence.
      ppo_epochs: update passes over the batch (actor and critic alike).
      use_ref: whether a reference forward pass runs.
      old_log_prob: whether the separate old-log-prob forward pass runs.
    """
    from hybridjax.metrics.flops import training_flops

    train = training_flops(actor, seq_lens)
    forwards = 1 + int(old_log_prob) + int(use_ref)  # rollout (+ old log-prob) (+ reference)
    total = train * ppo_epochs + forwards * train / 3
    if critic is not None:
        critic_train = training_flops(critic, seq_lens)
        total += critic_train * ppo_epochs + critic_train / 3
    return total


def measure(trainer, warmup: int, steps: int, out_dir: pathlib.Path | None = None) -> list[dict]:
    """Runs `warmup + steps` trainer steps; returns each step's metrics plus host wall/CPU time
    (`bench/wall_s`, `bench/cpu_s`), its start (`bench/start_s`, seconds after the first step
    began) and when each stage ran (`bench/stages`: stage, start_s, end_s on the same clock).
    With `out_dir`, the last step runs under the profilers (`recording.profile_step`) and
    carries the seconds per device of its collectives per stage (`bench/collective_time_s`,
    `recording.collective_time_s`)."""
    from experiments.benchmarks import recording

    out, origin = [], time.time()
    with recording.StageClock() as clock, recording.CompiledStages() as compiled:
        for step in range(1, warmup + steps + 1):
            start, wall, cpu = time.time(), time.perf_counter(), time.process_time()
            profiled = out_dir is not None and step == warmup + steps
            if profiled:
                metrics = recording.profile_step(lambda s=step: trainer.train_step(s), out_dir)
            else:
                metrics = trainer.train_step(step)
            metrics["bench/wall_s"] = time.perf_counter() - wall
            metrics["bench/cpu_s"] = time.process_time() - cpu
            metrics["bench/start_s"] = start - origin
            metrics["bench/stages"] = compiled.annotate(clock.take(origin), metrics)
            if profiled:
                events = recording.trace_events(out_dir / "trace")
                names = {e["stage"] for e in metrics["bench/stages"]}
                metrics["bench/collective_time_s"] = recording.collective_time_s(
                    events, names, trainer.n_devices
                )
            log.info("step %d: %s", step, json.dumps(metrics))
            out.append(metrics)
    return out


def summarize(metrics: list[dict], warmup: int, trainer, peak_flops: float) -> dict:
    """Medians over the timed steps: step time, steps/hour, tokens/s, stage times, MFU."""
    from experiments.benchmarks.recording import stability
    from hybridjax.training.build import critic_model_config

    timed = metrics[warmup:]
    med = lambda key: statistics.median(m[key] for m in timed)
    step_s, tokens = med("timing_s/step"), med("perf/total_num_tokens")
    stages = sorted({k for m in timed for k in m if k.startswith("timing_s/")})
    critic = critic_model_config(trainer.cfg, trainer.actor_config) if trainer.use_critic else None
    epochs = trainer.stage_cfg.actor_update.ppo_epochs
    seq_lens = _median_seq_lens(timed)
    old_pass = trainer.stage_cfg.recompute_old_log_prob
    flops = step_flops(trainer.actor_config, critic, seq_lens, epochs, trainer.use_ref, old_pass)
    n = trainer.n_devices
    return {
        "devices": n,
        "num_params": trainer.actor_config.num_params(),
        "peak_flops_per_device": peak_flops,
        "step_time_s": step_s,
        "step_cpu_time_s": med("bench/cpu_s"),
        "steps_per_hour": 3600.0 / step_s,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_device": tokens / step_s / n,
        "mfu_actor": med("perf/mfu/actor"),
        "mfu_step": flops / (step_s * n * peak_flops),
        "old_log_prob_pass": old_pass,
        "stages_s": {k.removeprefix("timing_s/"): med(k) for k in stages},
        "dominant_stage": max((k for k in stages if k != "timing_s/step"), key=med).removeprefix(
            "timing_s/"
        ),
        "step_times_s": [m["timing_s/step"] for m in timed],
        "stability": stability([m["timing_s/step"] for m in timed]),
        "communication": {
            "reshard_bytes": med("perf/reshard_bytes"),
            "reshard_s": med("timing_s/reshard"),
            "collective_bytes": {  # per device, each collective instruction once
                e["stage"]: e["compiled"]["collective_bytes"]
                for e in timed[-1]["bench/stages"]
                if "compiled" in e
            },
            # per device, from the profiled step's trace (`recording.collective_time_s`)
            "collective_time_s": timed[-1].get("bench/collective_time_s", {}),
        },
        "stage_peak_memory_bytes": stage_peaks(timed),
    }


def stage_peaks(timed: list[dict]) -> dict[str, int]:
    """Each stage's largest peak over the steps (`recording.StageMemory`: the device's running
    peak where it keeps statistics, else the process's resident peak during the stage)."""
    out: dict[str, int] = {}
    for m in timed:
        for e in m.get("bench/stages", []):
            peak = e.get("device_peak_bytes", e.get("host_peak_rss_bytes"))
            if peak is not None:
                out[e["stage"]] = max(out.get(e["stage"], 0), peak)
    return out


def _median_seq_lens(timed: list[dict]) -> np.ndarray:
    """Row lengths of the median-token step, as B rows of its mean length: the metrics keep no
    rows, so the dense FLOP term is exact and the attention term (a few % at these lengths) is
    slightly underestimated."""
    mid = sorted(timed, key=lambda m: m["perf/total_num_tokens"])[len(timed) // 2]
    mean = mid["prompt_length/mean"] + mid["response_length/mean"]
    rows = round(mid["perf/total_num_tokens"] / mean)
    return np.full(rows, mean, dtype=np.float64)


def peak_memory_bytes(metrics: list[dict] = ()) -> dict:
    """Peak memory so far: `device` (the first device's `peak_bytes_in_use`, where the backend
    keeps statistics: GPU, TPU) and `host` (the process's peak resident set: VmHWM, or the
    largest stage peak of `metrics`, since `recording.StageMemory` resets VmHWM per stage)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    with open("/proc/self/status") as f:
        hwm = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
    hwm = max([hwm, *stage_peaks(list(metrics)).values()])
    return {"device": stats.get("peak_bytes_in_use"), "host": hwm}


def run(cfg, out_dir: pathlib.Path) -> dict:
    from hybridjax.metrics import measure_peak_flops
    from hybridjax.rl.trainer import RLTrainer

    if cfg.workload:
        trainer_cfg, spec = workload_trainer_config(cfg.workload)
    else:
        trainer_cfg, spec = load_trainer_config(cfg.trainer_config), None
    trainer_cfg.update_from_flattened_dict(json.loads(cfg.overrides or "{}"))
    t = trainer_cfg.trainer
    t.default_local_dir = str(out_dir / "checkpoints")
    t.logger, t.progress_bar, t.resume_mode = (), False, "disable"
    t.total_training_steps = cfg.warmup + cfg.steps
    peak = measure_peak_flops()
    log.info("peak matmul FLOP/s per device: %.3g", peak)
    t.peak_flops = peak
    trainer = RLTrainer(trainer_cfg)
    try:
        metrics = measure(trainer, cfg.warmup, cfg.steps, out_dir if cfg.profile else None)
    finally:
        trainer.close()
    summary = summarize(metrics, cfg.warmup, trainer, peak)
    summary["peak_memory_bytes"] = peak_memory_bytes(metrics)
    if spec is not None:
        summary["workload"] = spec["name"]
    (out_dir / "steps.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return summary


def plot(summary: dict, out_dir: pathlib.Path) -> None:
    """Per-stage median time (`stages.png`) and step time per step (`steps.png`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = {k: v for k, v in summary["stages_s"].items() if k != "step"}
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.barh(list(stages), list(stages.values()), color="C0")
    ax.set_xlabel("median seconds per step")
    ax.set_title(
        f"step {summary['step_time_s']:.2f} s, {summary['tokens_per_s']:.0f} tokens/s, "
        f"MFU actor {summary['mfu_actor']:.1%}, step {summary['mfu_step']:.1%}"
    )
    fig.tight_layout()
    fig.savefig(out_dir / "stages.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(summary["step_times_s"]) + 1), summary["step_times_s"], marker="o")
    ax.set_xlabel("timed step")
    ax.set_ylabel("seconds")
    fig.tight_layout()
    fig.savefig(out_dir / "steps.png", dpi=100)
    plt.close(fig)
