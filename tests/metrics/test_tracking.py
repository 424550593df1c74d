"""Tracking: generation samples (JSONL, TensorBoard text), wandb offline, a missing package."""

import json
import struct
import sys

import pytest
from tensorboardX.proto import event_pb2

from hybridjax.config.checks import ConfigError
from hybridjax.metrics.tracking import Tracking, missing_logger_packages
from hybridjax.rl.checks import validate
from hybridjax.rl.evaluation import select_generations
from tests.rl.tiny_run import load_config_file

SAMPLES = [("1 + 2 =", "#### 3", 1.0), ("2 × 4 =", "Answer: 8", 0.0)]


def _tensorboard_texts(directory):
    """{tag: text} of the TensorBoard event files under `directory` (TFRecord framing)."""
    texts = {}
    for path in directory.rglob("events.out.tfevents.*"):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                if value.tensor.string_val:
                    tag = value.tag.removesuffix("/text_summary")
                    texts[tag] = value.tensor.string_val[0].decode()
    return texts


def test_generations_go_to_jsonl_and_tensorboard_not_metrics(tmp_path, capsys):
    tracker = Tracking(
        ("console", "jsonl", "tensorboard"),
        str(tmp_path),
        2,
        progress_bar=False,
        run_name=("proj", "exp1"),
        config={"trainer": {"experiment_name": "exp1"}},
    )
    tracker.log({"val-core/arithmetic/acc/mean@4": 0.5, "val/generations": SAMPLES}, 3)
    tracker.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
        "step": 3,
        "val-core/arithmetic/acc/mean@4": 0.5,
    }
    records = [json.loads(x) for x in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert records == [
        {"step": 3, "key": "val/generations", "prompt": p, "response": r, "score": s}
        for p, r, s in SAMPLES
    ]
    texts = _tensorboard_texts(tmp_path / "tensorboard" / "exp1")
    assert "**Input:** 2 × 4 =" in texts["val/generations"]
    assert "**Output:** #### 3" in texts["val/generations"]
    assert texts["run"] == "proj / exp1" and "exp1" in texts["config"]
    assert "#### 3" not in capsys.readouterr().out  # the console stays compact


def test_select_generations_is_verls_fixed_choice():
    samples = [(f"q{i}", f"r{i}", float(i)) for i in range(10)]
    chosen = select_generations(samples, 3)
    assert chosen == select_generations(list(reversed(samples)), 3)  # order-independent
    assert len(chosen) == 3 and select_generations(samples, 0) == []
    # verl: sorted by prompt, shuffled with RandomState(42), the first k
    order = list(range(10))
    __import__("numpy").random.RandomState(42).shuffle(order)
    assert chosen == [samples[i] for i in order[:3]]


def test_wandb_offline_names_the_run_and_resumes_it(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracking(
        ("wandb",), str(tmp_path), 2, run_name=("my-project", "my-exp"), config={"lr": 0.5}
    )
    run = tracker.wandb_run
    assert (run.project, run.name, run.config["lr"]) == ("my-project", "my-exp", 0.5)
    tracker.log({"critic/score/mean": 0.25, "val/generations": SAMPLES}, 1)
    tracker.log({"critic/score/mean": 0.5}, 2)  # commits step 1's row
    assert (run.summary["critic/score/mean"], run.summary["_step"]) == (0.25, 1)
    table = tracker._wandb_tables["val/generations"]
    assert table.columns[:4] == ["step", "input_1", "output_1", "score_1"]
    assert table.data == [[1, "1 + 2 =", "#### 3", 1.0, "2 × 4 =", "Answer: 8", 0.0]]
    run_id = run.id
    tracker.close()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    again = Tracking(("wandb",), str(tmp_path), 2, run_name=("my-project", "my-exp"))
    assert again.wandb_run.id == run_id  # a resumed training run continues its wandb run
    again.close()
    assert wandb.run is None


def test_missing_wandb_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    (message,) = missing_logger_packages(("console", "wandb"))
    assert "pip install -e '.[wandb]'" in message and "trainer.logger" in message
    with pytest.raises(ImportError, match=r"pip install -e '\.\[wandb\]'"):
        Tracking(("console", "wandb"), str(tmp_path), 1)
    assert missing_logger_packages(("console", "jsonl", "tensorboard")) == []
    # the trainer's config check says it before anything is built
    cfg = load_config_file("quickstart")
    cfg.trainer.logger = ("console", "wandb")
    with pytest.raises(ConfigError, match=r"trainer.logger includes 'wandb'.*\.\[wandb\]"):
        validate(cfg, 1)
