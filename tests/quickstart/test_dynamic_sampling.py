"""DAPO's dynamic sampling and a user stage end to end on the quick-start task, from the command
line (`configs/quickstart_dapo.py`): kept and dropped groups add up over several generation
batches per step, the user stage is timed, and the generation cap stops the run clearly."""

import json
import os
import subprocess
import sys

import pytest

from tests.child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = f"--config={ROOT}/configs/quickstart_dapo.py"
QUICK = ["--config.trainer.val_before_train=False", "--config.trainer.test_freq=-1",
         "--config.trainer.progress_bar=False", "--config.trainer.save_freq=-1"]  # fmt: skip
GROUPS = 16  # data.train_batch_size of the quick start


def _train(tmp_path, *flags):
    env = child_env(as_user=True, PYTHONPATH=ROOT)  # one CPU device, as a user's run
    return subprocess.run(
        [sys.executable, "-m", "hybridjax.train", CONFIG, *QUICK, *flags],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


@pytest.mark.slow
def test_dynamic_sampling_keeps_a_full_batch_of_varied_groups(tmp_path):
    proc = _train(tmp_path, "--config.trainer.total_training_steps=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = tmp_path / "checkpoints" / "hybridjax" / "quickstart_dapo" / "logs" / "metrics.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if "train/num_gen_batches" in r]
    assert len(steps) == 2
    for r in steps:
        batches = r["train/num_gen_batches"]
        assert r["train/num_kept_groups"] + r["train/num_dropped_groups"] == batches * GROUPS
        assert r["train/num_kept_groups"] >= GROUPS
        assert r["timing_s/zero_banned"] > 0 and r["reward/banned"] == 0.0
        assert "timing_s/filter_groups" in r
    assert max(r["train/num_gen_batches"] for r in steps) >= 2  # all-correct groups dropped

    capped = _train(tmp_path, "--config.trainer.total_training_steps=1",
                    "--config.algorithm.filter_groups.max_num_gen_batches=1")  # fmt: skip
    assert capped.returncode != 0
    assert "algorithm.filter_groups.max_num_gen_batches" in capped.stderr + capped.stdout
