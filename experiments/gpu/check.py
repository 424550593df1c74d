"""The GPU check: two commands of at most 8 minutes each, run in order of priority.

    python -m experiments.gpu.check part1 [--dry-run] [--out DIR] [--budget SECONDS]
    python -m experiments.gpu.check part2 ...

(`experiments/gpu/check.sh` installs the carried wheels first, then runs this.)

part1: `env` (versions, imports, devices, the measured bf16 matmul peak and copy bandwidth),
`tests` (the `gpu`-marked test files), `parity` (logits of small random Qwen2 and Llama
models against `transformers` on the GPU's torch), `grpo` (GRPO on a Qwen2.5-0.5B-shaped
model: stage times, compile time, peak memory per stage beside the planner's plan, MFU,
decode tokens/s against the HBM roofline).
part2: `kernels` (paged decode and training attention: time and memory per kernel), `trl_grpo`
(the same GRPO configuration in TRL's GRPOTrainer).

Each step runs as its own process (`experiments/gpu/step.py`) with a time limit (`LIMITS_S`,
cut to what is left of the part's budget) and writes `<out>/<step>.json` and `<step>.log` as
it goes; after each step `<out>/<part>.json` and `<out>/check.json` (every part run so far)
are rewritten, so a command cut short leaves its results. A step that fails or is skipped
prints one line with why, and the next step runs. `--dry-run`: CPU, tiny shapes, the same
code paths, `DRY_SLACK` times the limits and the budget. Exit status 1 when a step failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

from experiments.gpu.report import format_step, status_line

ROOT = pathlib.Path(__file__).resolve().parents[2]
PARTS = {"part1": ("env", "tests", "parity", "grpo"), "part2": ("kernels", "trl_grpo")}
LIMITS_S = {"env": 90, "tests": 150, "parity": 90, "grpo": 300, "kernels": 240, "trl_grpo": 300}
BUDGET_S = 450  # per part: under the GPU machine's 10 minutes a command, start-up included
MIN_STEP_S = 20  # a step is not started with less left than this
DRY_SLACK = 4  # a dry run's limits and budget: CPUs are slower and shared, and not rationed


def run_step(name: str, out: pathlib.Path, dry_run: bool, limit: float) -> dict:
    """Runs step `name` as its own process for at most `limit` seconds; its JSON, with status
    "failed" and why when the process died or ran out of time before writing one."""
    cmd = [sys.executable, "-m", f"experiments.gpu.{name}", "--out", str(out)]
    cmd += ["--dry-run"] if dry_run else []
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    }
    if dry_run:
        env["JAX_PLATFORMS"] = "cpu"
    start = time.perf_counter()
    log = out / f"{name}.log"
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=limit, check=False).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = None
    path = out / f"{name}.json"
    result = json.loads(path.read_text()) if path.is_file() else {"step": name, "tables": []}
    result["seconds"] = round(time.perf_counter() - start, 3)
    if rc is None:
        result |= {"status": "failed", "why": f"timed out after {limit:.0f} s (see {log.name})"}
    elif result.get("status") in (None, "running"):
        tail = (log.read_text().strip().splitlines() or ["no output"])[-1][:300]
        result |= {"status": "failed", "why": f"exit status {rc}: {tail}"}
    return result


def write_report(out: pathlib.Path, part: str, report: dict) -> None:
    """`<part>.json`, then `check.json`: the steps of every part found in `out`."""
    (out / f"{part}.json").write_text(json.dumps(report, indent=2, default=str))
    merged = {"parts": {}, "steps": {}}
    for name in PARTS:
        path = out / f"{name}.json"
        if path.is_file():
            done = json.loads(path.read_text())
            merged["parts"][name] = {k: v for k, v in done.items() if k != "steps"}
            merged["steps"] |= done["steps"]
    merged["ok"] = all(s.get("status") != "failed" for s in merged["steps"].values())
    (out / "check.json").write_text(json.dumps(merged, indent=2, default=str))


def run_part(part: str, out: pathlib.Path, dry_run: bool, budget: float) -> dict:
    """Runs the steps of `part` in order within `budget` seconds; the part's report."""
    slack = DRY_SLACK if dry_run else 1
    start = time.perf_counter()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    report = {"part": part, "started": stamp, "dry_run": dry_run, "steps": {}}
    for name in PARTS[part]:
        left = budget - (time.perf_counter() - start)
        if left < MIN_STEP_S:
            result = {
                "step": name,
                "status": "skipped",
                "why": f"{left:.0f} s left of {budget:.0f}",
            }
        else:
            limit = min(LIMITS_S[name] * slack, left)
            print(f"[{name}] running (at most {limit:.0f} s)", flush=True)
            result = run_step(name, out, dry_run, limit)
        report["steps"][name] = result
        report["seconds"] = round(time.perf_counter() - start, 3)
        write_report(out, part, report)
        print(format_step(result), flush=True)
    print("\n".join(["", f"{part} summary:", *map(status_line, report["steps"].values())]))
    print(out / "check.json")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=[*PARTS, "all"])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--out", default=str(ROOT / "results" / "gpu_check"), help="results folder")
    parser.add_argument("--budget", type=float, default=0, help=f"seconds per part ({BUDGET_S})")
    args = parser.parse_args()
    budget = args.budget or BUDGET_S * (DRY_SLACK if args.dry_run else 1)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = False
    for part in PARTS if args.part == "all" else (args.part,):
        report = run_part(part, out, args.dry_run, budget)
        failed |= any(s["status"] == "failed" for s in report["steps"].values())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
