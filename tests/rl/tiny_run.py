"""Helpers of the trainer's end-to-end tests: a GSM8K parquet subset and the tiny config."""

from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import pathlib
import shutil
import tempfile

import pyarrow.parquet as pq

from hybridjax.data import gsm8k

REPO = pathlib.Path(__file__).resolve().parents[2]
GSM8K_JSONL = REPO / "tests" / "assets" / "gsm8k"  # the MIT-licensed release, copied


def load_config_file(name: str):
    """`configs/<name>.py`'s `get_config()`."""
    spec = importlib.util.spec_from_file_location(name, REPO / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@functools.cache
def _gsm8k_parquet() -> pathlib.Path:
    """The real GSM8K jsonl preprocessed with the project's CLI, once per test process (2-7 s)."""
    full = pathlib.Path(tempfile.mkdtemp(prefix="gsm8k-"))
    atexit.register(shutil.rmtree, full, ignore_errors=True)
    gsm8k.main(["--input", str(GSM8K_JSONL), "--output", str(full)])
    return full


def gsm8k_subset(directory: pathlib.Path, train_rows: int = 64, test_rows: int = 16) -> dict:
    """The first rows of the preprocessed GSM8K splits, written to `directory`."""
    full = _gsm8k_parquet()
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, rows in (("train", train_rows), ("test", test_rows)):
        path = directory / f"{split}.parquet"
        pq.write_table(pq.read_table(full / f"{split}.parquet").slice(0, rows), path)
        out[split] = str(path)
    return out


def tiny_config(data: dict, run_dir: pathlib.Path, **changes):
    """configs/tiny.py on the GSM8K subset, quiet, sized for tests; `changes` are dotted keys."""
    c = load_config_file("tiny")
    c.data.train_files = data["train"]
    c.data.val_files = data["test"]
    c.data.max_prompt_length = 192
    c.data.max_response_length = 16
    c.data.train_batch_size = 8
    c.data.val_max_samples = 8
    c.actor_rollout_ref.rollout.prompt_length = 192
    c.actor_rollout_ref.rollout.response_length = 16
    c.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 1
    c.actor_rollout_ref.actor.ppo_mini_batch_size = 8
    c.critic.ppo_mini_batch_size = 8
    c.trainer.default_local_dir = str(run_dir)
    c.trainer.logger = ("jsonl",)
    c.trainer.progress_bar = False
    c.trainer.peak_flops = 1e10
    c.trainer.test_freq = 2
    c.trainer.save_freq = 1
    c.update_from_flattened_dict(changes)
    return c


def read_metrics(run_dir: pathlib.Path) -> dict[int, dict]:
    """step → metrics from the run's JSONL log (the last record of a step wins)."""
    out = {}
    for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record.pop("step")] = record
    return out
