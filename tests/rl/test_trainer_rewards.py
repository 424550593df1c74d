"""The reward stage in full runs: SIGTERM while a reward function hangs, a served reward model
combined with the rule's score."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time

import pytest
from flax import nnx

from hybridjax.models.decoder import SequenceClassifier
from hybridjax.models.hf_io import save_pretrained
from hybridjax.rewards.serve import start_local
from hybridjax.rl.trainer import RLTrainer
from hybridjax.training import build
from tests.child_env import child_env
from tests.rl.tiny_run import gsm8k_subset, read_metrics, tiny_config

pytestmark = pytest.mark.slow

HANGING = """
import os, time
from hybridjax.rewards import default_compute_score

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # Once armed, the first row to get here hangs (the others score as usual).
    if os.path.exists({arm!r}):
        try:
            os.close(os.open({hung!r}, os.O_CREAT | os.O_EXCL))
            time.sleep(3600)
        except FileExistsError:
            pass
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""
TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return gsm8k_subset(tmp_path_factory.mktemp("gsm8k"), train_rows=32, test_rows=8)


def test_sigterm_during_a_hanging_reward_saves_the_step(data, tmp_path):
    """Step 2's reward function hangs on one row; SIGTERM arrives meanwhile. The row times out
    (counted, scored 0), so the reward stage waits about the timeout, not the hang; step 2
    completes and is checkpointed, and the run returns (the rest of the step and the save
    take a few seconds more on the tiny config, more on a loaded machine)."""
    arm, hung = str(tmp_path / "arm"), str(tmp_path / "hung")
    (tmp_path / "reward.py").write_text(HANGING.format(arm=arm, hung=hung))
    config = tiny_config(
        data,
        tmp_path / "run",
        **{
            "trainer.total_training_steps": 4,
            "trainer.save_freq": -1,  # checkpoints only at the end and on SIGTERM
            "trainer.test_freq": -1,
            "trainer.val_before_train": False,
            "custom_reward_function.path": str(tmp_path / "reward.py"),
            "reward_model.timeout_s": TIMEOUT_S,
            "reward_model.num_workers": 2,
        },
    )
    trainer = RLTrainer(config)
    step = trainer.train_step
    sent = {}

    def train_step(n):
        if n == 2:
            open(arm, "w").close()
        return step(n)

    def send_sigterm_once_hung():
        while not os.path.exists(hung):
            time.sleep(0.05)
        sent["at"] = time.perf_counter()
        os.kill(os.getpid(), signal.SIGTERM)

    trainer.train_step = train_step
    threading.Thread(target=send_sigterm_once_hung, daemon=True).start()
    trainer.fit()
    elapsed = time.perf_counter() - sent["at"]
    trainer.close()
    assert trainer.global_step == 2
    assert trainer.checkpointer.steps() == [2]
    metrics = read_metrics(tmp_path / "run")
    # the hang is an hour; the timeout cut it (the other rows and the worker's replacement take
    # seconds more on a loaded 2-core machine: 6.1 s seen)
    assert metrics[2]["timing_s/reward"] < TIMEOUT_S + 15, metrics[2]["timing_s/reward"]
    assert elapsed < TIMEOUT_S + 30, elapsed
    assert metrics[2]["reward/num_timeouts"] == 1.0 and metrics[1]["reward/num_timeouts"] == 0


def test_served_reward_model_summed_with_the_rule(data, tmp_path):
    """GRPO with the reward model on its own server (2 simulated CPU devices) and
    `reward_model.combine=sum`: the scores are the model's plus the rule's, latency reported."""
    config = tiny_config(
        data,
        tmp_path / "run",
        **{
            "algorithm.adv_estimator": "grpo",
            "critic.enable": False,
            "actor_rollout_ref.rollout.n": 2,
            "trainer.total_training_steps": 2,
            "trainer.test_freq": -1,
            "reward_model.enable": True,
            "reward_model.combine": "sum",
        },
    )
    tokenizer = build.load_tokenizer(config)
    shape = build.actor_model_config(config, tokenizer)
    rm = SequenceClassifier(dataclasses.replace(shape, num_labels=1), nnx.Rngs(7))
    save_pretrained(rm, tmp_path / "rm")
    env = child_env(devices=2)
    process, url = start_local(["--model_path", str(tmp_path / "rm")], env=env)
    try:
        config.reward_model.remote.urls = url
        trainer = RLTrainer(config)
        assert trainer.models.reward_model is None  # not loaded in the trainer
        trainer.fit()
        trainer.close()
    finally:
        process.terminate()
        process.wait(timeout=30)
    metrics = read_metrics(tmp_path / "run")
    for step in (1, 2):
        assert all(math.isfinite(v) for v in metrics[step].values())
        assert metrics[step]["reward/remote_latency_ms"] > 0
        assert metrics[step]["reward/num_errors"] == 0
        # A random model's scores are not the rule's 0 / 1.
        assert metrics[step]["critic/score/max"] != metrics[step]["critic/score/min"]
