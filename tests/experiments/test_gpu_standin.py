"""The GPU check starts: its CPU stand-in (Python 3.12, JAX 0.11.2, only the GPU image's
packages plus the carried wheels; `experiments/gpu/standin.sh`) is built from the repository
and runs the whole check in dry-run mode. Every step ends ok or with a clear skip, and the JSON
carries the planned-vs-measured fields the GPU report is made of."""

import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = ("env", "tests", "parity", "grpo", "kernels", "trl_grpo")


@pytest.mark.slow
def test_the_standin_runs_every_step_of_the_check(tmp_path):
    out = tmp_path / "check"
    script = ROOT / "experiments" / "gpu" / "standin.sh"
    # one CPU device, as on the GPU machine: not the suite's simulated devices
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "HYBRIDJAX_"))}
    done = subprocess.run(
        ["bash", str(script), "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert (out / "check.json").is_file(), done.stderr[-3000:]
    report = json.loads((out / "check.json").read_text())
    steps = report["steps"]
    assert list(steps) == list(STEPS), done.stdout[-3000:]
    for name, step in steps.items():
        assert step["status"] in ("ok", "skipped"), f"{name}: {step.get('why')}"
        assert step["status"] == "ok" or step["why"], name  # a skip says why
    assert done.returncode == 0 and report["ok"], done.stdout[-3000:]
    assert steps["env"]["jax_version"] == "0.11.2"
    assert steps["parity"]["why"].startswith("no torch")  # the stand-in has no torch
    assert steps["trl_grpo"]["why"].startswith("no torch")
    assert steps["tests"]["counted"]["tests"] > 0  # collected (and skipped on CPU)

    grpo = steps["grpo"]
    stages = grpo["tables"][0]
    assert {"plan peak GB", "device peak GB"} <= set(stages["columns"])
    planned = {row[0]: row[3] for row in stages["rows"]}
    assert planned["update_actor"] > 0 and planned["gen"] > 0
    summary = grpo["summary"]
    assert 0 < summary["mfu_actor"] < 1
    assert 0 < summary["decode"]["tokens_per_s"] < summary["decode"]["roofline_tokens_per_s"]
    assert summary["plan_peak_bytes"] > 0 and len(summary["compile_s"]) == 3

    kernels = {t["title"].split(",")[0]: t["rows"] for t in steps["kernels"]["tables"]}
    decode = {row[1]: row[2] for row in kernels["paged decode"]}
    assert decode == {"jnp": "ok", "jnp blocked": "ok", "pallas (interpreted)": "ok"}
    train = {row[1]: row[2] for row in kernels["training attention"]}
    assert train["blocked"] == train["xla"] == "ok" and train["cudnn"].startswith("skipped")
    assert "[trl_grpo] skipped" in done.stdout  # the report prints a line per skip
