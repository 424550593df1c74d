"""End to end: the quick start learns (the README's command, shortened) and the SFT command
line (the notebooks: tests/notebooks). All slow: each runs minutes of CPU."""

import json
import os
import subprocess
import sys

import pytest

from tests.child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VAL_KEY = "val-core/arithmetic/acc/mean@1"
# The CI variant of `python -m hybridjax.train` (no flags = configs/quickstart.py): fewer steps.
QUICK_STEPS = 10


def _run(args, tmp_path, timeout):
    env = child_env(as_user=True)  # one CPU device, as a user's run
    proc = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_quickstart_accuracy_rises(tmp_path):
    out = _run(
        [
            "hybridjax.train",
            f"--config.trainer.total_training_steps={QUICK_STEPS}",
            f"--config.trainer.test_freq={QUICK_STEPS}",
            "--config.trainer.progress_bar=False",
        ],
        tmp_path,
        timeout=900,
    )
    log_dir = tmp_path / "checkpoints" / "hybridjax" / "quickstart" / "logs"
    with open(log_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    accuracy = {r["step"]: r[VAL_KEY] for r in records if VAL_KEY in r}
    assert sorted(accuracy) == [0, QUICK_STEPS]
    assert accuracy[QUICK_STEPS] - accuracy[0] >= 0.15, accuracy
    # nothing compiles after the first step (tests/rl/test_compiles.py names what would)
    compiles = {r["step"]: r["perf/num_compiles"] for r in records if "perf/num_compiles" in r}
    assert compiles[QUICK_STEPS] == compiles[1], compiles
    for name in ("reward", "val_accuracy", "response_length", "timing"):
        assert (log_dir / f"{name}.png").stat().st_size > 1000
    assert f"written to {log_dir}" in out
    # a quiet console: step lines, no INFO lines; those are in the run's log file
    assert "step 10 | score" in out and "compiling" not in out and "INFO" not in out
    assert "INFO hybridjax.rollout.engine: compiling" in (log_dir / "train.log").read_text()


@pytest.mark.slow
def test_sft_command_line(tmp_path):
    _run(["hybridjax.data.arithmetic", "--output", "data", "--train_size", "256"], tmp_path, 300)
    _run(
        [
            "hybridjax.sft",
            f"--config={ROOT}/configs/sft_arithmetic.py",
            "--config.data.train_files=data/sft.parquet",
            "--config.trainer.total_training_steps=3",
            "--config.model.override_config.num_hidden_layers=1",
        ],
        tmp_path,
        300,
    )
    hf = tmp_path / "checkpoints" / "hybridjax" / "sft_arithmetic" / "hf"
    assert (hf / "model.safetensors").is_file() and (hf / "tokenizer.json").is_file()
    with open(hf / "config.json") as f:
        assert json.load(f)["num_hidden_layers"] == 1
