"""The one-command GPU check's steps (`experiments/gpu/check.sh` installs, then runs this).

Steps, each a subprocess with a time limit; a failing step is recorded and the next one runs:

1. `env`: JAX version, backend and devices, `nvidia-smi` (when present);
2. `tests`: every `gpu`-marked test under `tests/`, selected by the marker, not by path
   (`GPU_TESTS`; `tests/gpu`: Pallas paged attention, blocked training attention, bfloat16
   parity against float32 and `transformers`; packed attention in `tests/trainer`; any GPU test
   added elsewhere) with `jax_platforms=cuda,cpu`;
3. `plan`: `python -m hybridjax.plan` of `configs/gpu_check.py` on simulated CPU devices;
4. `throughput`: the RL-step benchmark on `configs/gpu_check.py` (a random Qwen2.5-0.5B-shaped
   actor, GRPO, bfloat16), with the device's peak memory;
5. `generation`: the rollout engine against HF `generate` on the same shape;
6. `plan_vs_measured`: per stage, the plan's peak beside the throughput run's measured peak
   (the device's `peak_bytes_in_use` after the stage on GPU; the process's resident peak
   during it on CPU).

Everything lands in one JSON (`<out>/check.json`): each step's return code, seconds, the tail
of its output and its numbers. `--dry-run` runs the same steps on CPU with tiny sizes (the
workload `tiny`, the quick generation settings), where the `gpu` tests are skipped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
GPU_TESTS = ("-m", "gpu", "tests")  # pytest selection: the marker over the whole test tree


def step(name: str, cmd: list[str], env: dict, timeout: int, log_dir: pathlib.Path) -> dict:
    """Runs `cmd`; returns {rc, seconds, tail} (rc 124 on timeout). Output goes to <name>.log."""
    start = time.perf_counter()
    print(f"[check] {name}: {' '.join(cmd)}", flush=True)
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        rc, out = 124, f"{err.stdout or ''}{err.stderr or ''}\ntimed out after {timeout} s"
    (log_dir / f"{name}.log").write_text(out if isinstance(out, str) else out.decode())
    seconds = time.perf_counter() - start
    print(f"[check] {name}: rc {rc}, {seconds:.0f} s", flush=True)
    return {"rc": rc, "seconds": seconds, "tail": str(out)[-2000:]}


def _last_results_dir(text: str) -> pathlib.Path | None:
    """The `results/<stamp>` folder a benchmark run printed last."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if (
            line
            and len(line) < 1024
            and " " not in line
            and (ROOT / line / "summary.json").is_file()
        ):
            return ROOT / line
    return None


def _junit_counts(xml: pathlib.Path) -> dict:
    import xml.etree.ElementTree as ET

    if not xml.is_file():
        return {}
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    keys = ("tests", "failures", "errors", "skipped")
    return {k: int(suite.get(k, 0)) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes")
    parser.add_argument("--out", default="", help="output folder (default results/gpu_check_*)")
    args = parser.parse_args()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d_%H%M%S")
    out = pathlib.Path(args.out or ROOT / "results" / f"gpu_check_{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    py, dry = sys.executable, args.dry_run
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    }
    if dry:
        env["JAX_PLATFORMS"] = "cpu"
    report: dict = {"dry_run": dry, "started": stamp, "steps": {}}
    steps = report["steps"]

    probe = (
        "import json, jax; d = jax.devices(); print(json.dumps(dict(jax=jax.__version__, "
        "backend=jax.default_backend(), devices=[str(x) for x in d], "
        "memory=[(x.memory_stats() or {}).get('bytes_limit') for x in d])))"
    )
    steps["env"] = step("env", [py, "-c", probe], env, 300, out)
    if steps["env"]["rc"] == 0:
        steps["env"] |= json.loads(steps["env"]["tail"].strip().splitlines()[-1])
    if shutil.which("nvidia-smi"):
        smi = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"]
        steps["nvidia_smi"] = step("nvidia_smi", smi, env, 60, out)

    xml = out / "tests.xml"
    test_env = env | {"HYBRIDJAX_TEST_PLATFORMS": "cpu" if dry else "cuda,cpu"}
    tests = [py, "-m", "pytest", "-q", *GPU_TESTS, f"--junitxml={xml}"]
    steps["tests"] = step("tests", tests, test_env, 1200, out) | _junit_counts(xml)

    if not (ROOT / "data/gsm8k/train.parquet").is_file():
        prep = [py, "-m", "hybridjax.data.gsm8k", "--input", "tests/assets/gsm8k"]
        steps["data"] = step("data", [*prep, "--output", "data/gsm8k"], env, 600, out)

    trainer = "configs/tiny.py" if dry else "configs/gpu_check.py"
    plan_json = out / "plan.json"
    plan = [py, "-m", "hybridjax.plan", f"--config={trainer}", "--devices=1"]
    limits = [m for m in steps["env"].get("memory", []) if m] or [80e9]
    plan += [f"--json={plan_json}", f"--device_memory_gb={limits[0] / 1e9:.1f}"]
    steps["plan"] = step("plan", plan, env, 1800, out)
    if plan_json.is_file():
        steps["plan"]["plan"] = json.loads(plan_json.read_text())

    bench = [py, "-m", "experiments.benchmarks.run"]
    thr = [*bench, "--config=configs/bench_throughput.py", f"--config.results_root={out}"]
    thr += ["--config.throughput.steps=3"]
    if dry:
        thr += ["--config.throughput.workload=tiny", "--config.throughput.steps=1"]
    else:
        thr += ["--config.throughput.workload=", f"--config.throughput.trainer_config={trainer}"]
    steps["throughput"] = step("throughput", thr, env, 1800, out)
    gen = [*bench, "--config=configs/bench_generation.py", f"--config.results_root={out}"]
    if dry:
        gen += ["--config.generation.models=tiny", "--config.generation.batches=2"]
        gen += ["--config.generation.new_tokens=8", "--config.generation.repeats=1"]
        gen += ["--config.generation.continuous_model=tiny", "--config.generation.requests=8"]
    else:
        gen += ["--config.generation.models=0.5B", "--config.generation.batches=1,16"]
        gen += ["--config.generation.new_tokens=64", "--config.generation.repeats=1"]
        gen += ["--config.generation.continuous_model=4M"]
    steps["generation"] = step("generation", gen, env, 1800, out)
    for name in ("throughput", "generation"):
        folder = _last_results_dir((out / f"{name}.log").read_text())
        if folder is not None:
            steps[name]["results"] = str(folder)
            steps[name]["summary"] = json.loads((folder / "summary.json").read_text())

    report["plan_vs_measured"] = plan_vs_measured(steps)
    report["ok"] = all(s["rc"] == 0 for s in steps.values())
    (out / "check.json").write_text(json.dumps(report, indent=2, default=str))
    print(out / "check.json")
    sys.exit(0 if report["ok"] else 1)


def plan_vs_measured(steps: dict) -> dict:
    """stage → {planned_bytes, measured_bytes} where both the plan and the throughput run
    have the stage (see the module docstring)."""
    plan = steps.get("plan", {}).get("plan", {}).get("stages", {})
    measured = steps.get("throughput", {}).get("summary", {}).get("stage_peak_memory_bytes", {})
    return {
        name: {"planned_bytes": plan[name]["peak_bytes"], "measured_bytes": measured[name]}
        for name in plan
        if name in measured
    }


if __name__ == "__main__":
    main()
