"""A training run whose reward function starts failing on most rows (a dependency gone, a
server killed) stops after `reward_model.max_consecutive_failed_steps` steps, with a message,
and saves no checkpoint from those steps, even under `on_error=zero` (slow: trains)."""

from __future__ import annotations

import os

import pytest

from hybridjax.rewards.guard import RewardFailureError
from hybridjax.rl.trainer import RLTrainer
from tests.rl.tiny_run import gsm8k_subset, tiny_config

pytestmark = pytest.mark.slow

# Each worker process scores its first row, then fails every row: with 2 workers, at most 2
# rows of the whole run score, so the first batch is not all failures (no first-batch stop)
# but every step is mostly failures.
FADING = """
CALLS = 0

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global CALLS
    CALLS += 1
    if CALLS > 1:
        raise ConnectionError("reward backend went away")
    return 1.0
"""


def test_mostly_failing_rewards_stop_the_run_before_a_checkpoint(tmp_path):
    data = gsm8k_subset(tmp_path, train_rows=48, test_rows=8)
    (tmp_path / "fading.py").write_text(FADING)
    run = tmp_path / "run"
    cfg = tiny_config(
        data,
        run,
        **{
            "custom_reward_function.path": str(tmp_path / "fading.py"),
            "reward_model.num_workers": 2,
            "reward_model.on_error": "zero",
            "trainer.total_training_steps": 5,
            "trainer.test_freq": -1,
        },
    )
    trainer = RLTrainer(cfg)
    try:
        with pytest.raises(RewardFailureError) as err:
            trainer.fit()
    finally:
        trainer.close()
    message = str(err.value)
    assert "Steps 1-3: most rows failed in 3 consecutive steps" in message
    assert "ConnectionError('reward backend went away')" in message
    assert not [name for name in os.listdir(run) if name.startswith("global_step")]
