"""Step `grpo`: `configs/gpu_check.py` (GRPO on a random Qwen2.5-0.5B-shaped actor, bfloat16,
8 prompts × 5 samples, 256 + 512 tokens) for one warm-up step and 2 timed steps, beside the
memory planner's plan of the same config on the same device.

Measured (`hybridjax.rl.RLTrainer`, stage spans from `experiments.benchmarks.recording`):

* every stage's seconds, warm-up and median of the timed steps; compile seconds per step
  (JAX's `/jax/core/compile/backend_compile_duration` events);
* memory after each stage of the warm-up step (the first time each stage runs):
  `memory_stats()`'s `peak_bytes_in_use` (a running peak: it only rises, so a stage shows the
  peak of everything so far) and `bytes_in_use`; beside them the plan's peak of that stage
  (`hybridjax.memory.planner.plan_memory`, counted from shapes, the device's `bytes_limit`);
* MFU of the actor update against the bf16 matmul peak measured by step `env` (measured
  here when `env` did not run): `perf/mfu/actor` with `trainer.peak_flops` set to it;
* decode tokens/s (rows × mean response length / `timing_s/gen`, prefill included) against
  the HBM roofline: each of the R decode steps reads the rollout weights W once and the KV
  cache of all rows, so at copy bandwidth BW (step `env`) the fastest generation takes
  Σₜ (W + rows·(P̄ + t)·kv) / BW = (R·W + rows·kv·(R·P̄ + R²/2)) / BW for rows rows of mean
  prompt P̄, kv bytes of K and V per token over all layers, R the longest response.

A dry run shrinks the model and the batch (`DRY_OVERRIDES`) and runs on CPU, where the plan
targets the CPU and memory is the process's (no `memory_stats()`).
"""

from __future__ import annotations

import collections
import json
import logging
import pathlib
import statistics
import subprocess
import sys
import time

from experiments.gpu.step import ROOT, Context, main

CONFIG = ROOT / "configs" / "gpu_check.py"
WARMUP, TIMED = 1, 2
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
DRY_OVERRIDES = {
    "actor_rollout_ref.model.override_config": dict(
        vocab_size=1024,  # the shipped tokenizer has 1000 ids
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        attention_bias=True,
    ),
    "data.train_batch_size": 2,
    "data.max_response_length": 16,
    "actor_rollout_ref.rollout.response_length": 16,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 5,
    "actor_rollout_ref.rollout.max_num_seqs": 10,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 10,
}
GB = 1e9


class CompileSeconds:
    """Sums JAX's backend compile durations while registered (`take` returns and resets)."""

    def __init__(self):
        import jax

        self.seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **_) -> None:
        if event == COMPILE_EVENT:
            self.seconds += duration

    def take(self) -> float:
        out, self.seconds = self.seconds, 0.0
        return out


def trainer_config(dry_run: bool, out: pathlib.Path):
    """`configs/gpu_check.py` for this run (`DRY_OVERRIDES` in a dry run)."""
    from experiments.benchmarks.throughput import load_trainer_config

    cfg = load_trainer_config(str(CONFIG))
    if dry_run:
        cfg.update_from_flattened_dict(DRY_OVERRIDES)
    t = cfg.trainer
    t.default_local_dir = str(out / "grpo_checkpoints")
    t.logger, t.progress_bar, t.resume_mode = (), False, "disable"
    t.total_training_steps = WARMUP + TIMED
    return cfg


def prepare_data(cfg) -> None:
    """The GSM8K parquet from the shipped sample, where `cfg.data.train_files` is missing."""
    if (ROOT / cfg.data.train_files).is_file():
        return
    out = str(pathlib.Path(cfg.data.train_files).parent)
    cmd = [sys.executable, "-m", "hybridjax.data.gsm8k", "--input", "tests/assets/gsm8k"]
    subprocess.run([*cmd, "--output", out], cwd=ROOT, check=True)


def run_steps(trainer, compiles: CompileSeconds) -> list[dict]:
    """WARMUP + TIMED trainer steps; each step's metrics with `bench/stages` (stage spans and
    memory after each) and `bench/compile_s`, `bench/cpu_s`."""
    from experiments.benchmarks.recording import StageClock

    out, origin = [], time.time()
    with StageClock() as clock:
        for step in range(1, WARMUP + TIMED + 1):
            cpu = time.process_time()
            metrics = trainer.train_step(step)
            metrics["bench/cpu_s"] = time.process_time() - cpu
            metrics["bench/compile_s"] = compiles.take()
            metrics["bench/stages"] = clock.take(origin)
            logging.info("step %d: %s", step, json.dumps(metrics, default=str))
            out.append(metrics)
    return out


def decode_roofline(trainer, metrics: dict, bandwidth: float) -> dict:
    """Measured decode tokens/s and the HBM roofline's (module docstring) of one step."""
    c = trainer.actor_config
    rows = trainer.cfg.data.train_batch_size * trainer.cfg.actor_rollout_ref.rollout.n
    prompt, resp_mean = metrics["prompt_length/mean"], metrics["response_length/mean"]
    resp_max = metrics.get("response_length/max", resp_mean)
    weights = c.num_params() * 2  # bf16 rollout weights
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.resolved_head_dim * 2
    roofline_s = (
        resp_max * weights + rows * kv * (resp_max * prompt + resp_max**2 / 2)
    ) / bandwidth
    tokens = rows * resp_mean
    return {
        "tokens_per_s": tokens / metrics["timing_s/gen"],
        "roofline_tokens_per_s": tokens / roofline_s,
        "rows": rows,
        "weight_bytes": weights,
        "kv_bytes_per_token": kv,
    }


def stage_rows(metrics: list[dict], plan) -> list[list]:
    """[stage, warm-up s, timed median s, planned peak GB, device peak GB, in use GB]."""
    warm = {e["stage"]: e for e in metrics[0]["bench/stages"]}
    timed = collections.defaultdict(list)
    for m in metrics[WARMUP:]:
        for key, value in m.items():
            if key.startswith("timing_s/"):
                timed[key.removeprefix("timing_s/")].append(value)
    planned = {s.name: s.peak for s in plan.stages}
    rows = []
    for stage in dict.fromkeys([*warm, *planned, *timed]):
        e = warm.get(stage, {})
        peak = e.get("device_peak_bytes", e.get("host_peak_rss_bytes"))
        in_use = e.get("device_bytes_in_use")
        rows.append([
            stage,
            metrics[0].get(f"timing_s/{stage}"),
            statistics.median(timed[stage]) if timed.get(stage) else None,
            planned[stage] / GB if stage in planned else None,
            peak / GB if peak is not None else None,
            in_use / GB if in_use is not None else None,
        ])  # fmt: skip
    return rows


def run(ctx: Context) -> None:
    import jax

    from experiments.gpu.env import measure_ceilings
    from hybridjax.memory.planner import plan_memory
    from hybridjax.rl.trainer import RLTrainer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ceilings = ctx.earlier("env").get("ceilings") or measure_ceilings(ctx.dry_run)
    cfg = trainer_config(ctx.dry_run, ctx.out)
    prepare_data(cfg)
    cfg.trainer.peak_flops = ceilings["bf16_matmul_flops"]
    compiles = CompileSeconds()
    built = time.perf_counter()
    trainer = RLTrainer(cfg)
    setup = {"build_s": time.perf_counter() - built, "build_compile_s": compiles.take()}
    target = "gpu" if jax.default_backend() == "gpu" else "cpu"
    plan = plan_memory(trainer.cfg, trainer.actor_config, trainer.n_devices, target=target,
                       compile_stages=False)  # fmt: skip
    ctx.save(plan=plan.to_dict(), setup=setup, num_params=trainer.actor_config.num_params())
    try:
        metrics = run_steps(trainer, compiles)
    finally:
        trainer.close()
    (ctx.out / "grpo_steps.jsonl").write_text(
        "".join(json.dumps(m, default=str) + "\n" for m in metrics)
    )
    columns = ["stage", "warm-up s", "timed s", "plan peak GB", "device peak GB", "in use GB"]
    ctx.table("stages: time, and memory after the stage beside the plan", columns,
              stage_rows(metrics, plan))  # fmt: skip
    last = metrics[-1]
    decode = decode_roofline(trainer, last, ceilings["copy_bytes_per_s"])
    mfu = statistics.median(m["perf/mfu/actor"] for m in metrics[WARMUP:])
    peak = (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    summary = {
        "step_s": statistics.median(m["timing_s/step"] for m in metrics[WARMUP:]),
        "compile_s": [m["bench/compile_s"] for m in metrics],
        "mfu_actor": mfu,
        "decode": decode,
        "device_peak_bytes": peak,
        "plan_peak_bytes": plan.worst.peak,
    }
    ctx.save(summary=summary)
    rows = [
        ["step s (timed median)", summary["step_s"], None, None],
        ["compile s: warm-up step | timed steps", summary["compile_s"][0],
         sum(summary["compile_s"][1:]), None],
        ["update MFU vs bf16 peak", mfu, 1.0, mfu],
        ["decode tokens/s vs HBM roofline", decode["tokens_per_s"],
         decode["roofline_tokens_per_s"], decode["tokens_per_s"] / decode["roofline_tokens_per_s"]],
        ["peak GB vs plan's worst stage", peak / GB if peak else None, plan.worst.peak / GB,
         peak / plan.worst.peak if peak else None],
    ]  # fmt: skip
    ctx.table("measured vs reference", ["quantity", "measured", "reference", "ratio"], rows)


if __name__ == "__main__":
    main("grpo", run)
