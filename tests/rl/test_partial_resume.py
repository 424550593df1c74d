"""Partial rollouts resumed from a checkpoint (`trainer.partial_rollout`): the prompts in flight
are saved with each checkpoint, so a run resumed at any step finishes, and every batch it
trains equals the uninterrupted run's (staleness 1: every round swaps the weights and
recomputes the carried sequences, so the recompute is exact), a resumed run's checkpoint resumes
again the same way, a resume at the last step says there is nothing left and trains nothing, and
a finished run resumed with more steps trains them."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from hybridjax.rl.trainer import RLTrainer
from tests.rl.tiny_run import gsm8k_subset, tiny_config

pytestmark = pytest.mark.slow

STEPS = 3
CHANGES = {
    "trainer.total_training_steps": STEPS,
    "trainer.test_freq": -1,
    "trainer.save_freq": 1,
    "trainer.max_actor_ckpt_to_keep": STEPS,
    "trainer.rollout_mode": "async",
    "trainer.staleness_threshold": 1,
    "trainer.partial_rollout": True,
    "algorithm.adv_estimator": "grpo",
    "critic.enable": False,
    "actor_rollout_ref.rollout.n": 2,
    "actor_rollout_ref.rollout.max_num_seqs": 8,  # 16 samples a batch: some carry over
}


def _config(data, run, **changes):
    """The tiny config, rollout on devices 0-3 and training on 4-7 (async needs a pool)."""
    c = tiny_config(data, run, **(CHANGES | changes))
    c.resource_pool = dict(rollout_pool=dict(n_devices=4), global_pool=dict(n_devices=4))
    c.placement.rollout = "rollout_pool"
    return c


def _fit(config) -> dict[int, tuple]:
    """Runs `fit`; returns step → (prompt indices, responses, token versions) of each batch."""
    trainer = RLTrainer(config)
    batches = {}
    take = trainer.partial.take

    def recorded(step, count):
        prompts, out, versions = take(step, count)
        batches[step] = (np.asarray(prompts["index"]), out.responses.copy(), versions.copy())
        return prompts, out, versions

    trainer.partial.take = recorded
    try:
        trainer.fit()
    finally:
        trainer.close()
    return batches


def test_a_partial_rollout_run_resumed_at_every_step_trains_the_same_batches(tmp_path, caplog):
    data = gsm8k_subset(tmp_path / "gsm8k", train_rows=24, test_rows=8)
    whole = _fit(_config(data, tmp_path / "whole"))
    assert sorted(whole) == [1, 2, 3]
    carried = [(v >= 0).any(1) & (v < step - 1).any(1) for step, (_, _, v) in whole.items()]
    assert any(c.any() for c in carried)  # some batch holds samples begun a round before
    for step in range(1, STEPS + 1):
        at = str(tmp_path / "whole" / f"global_step_{step}")
        run = tmp_path / f"from_{step}"
        caplog.clear()
        with caplog.at_level(logging.INFO):
            resumed = _fit(_config(data, run, **{"trainer.resume_mode": at}))
        assert sorted(resumed) == list(range(step + 1, STEPS + 1))
        for n, (index, responses, versions) in resumed.items():
            np.testing.assert_array_equal(index, whole[n][0], err_msg=f"from {step}, step {n}")
            np.testing.assert_array_equal(responses, whole[n][1], err_msg=f"{step}, {n}")
            np.testing.assert_array_equal(versions, whole[n][2], err_msg=f"{step}, {n}")
        if step == 1:  # a resumed run's own checkpoint resumes too, and trains the same batch
            twice = {"trainer.resume_mode": str(run / "global_step_2")}
            again = _fit(_config(data, tmp_path / "again", **twice))
            assert sorted(again) == [3]
            for a, b in zip(again[3], whole[3], strict=True):
                np.testing.assert_array_equal(a, b, err_msg="resumed twice, step 3")
            caplog.clear()  # and without partial rollouts, saying what it drops
            off = {"trainer.resume_mode": at, "trainer.partial_rollout": False}
            trainer = RLTrainer(_config(data, tmp_path / "off", **off))
            with caplog.at_level(logging.INFO):
                trainer.fit()
            trainer.close()
            assert "prompts in flight of a partial-rollout run" in caplog.text
            assert os.path.isdir(tmp_path / "off" / f"global_step_{STEPS}")
        if step == STEPS:
            assert "no steps left: the run is at step 3 and trains 3 steps" in caplog.text
            assert not any(n.startswith("global_step") for n in os.listdir(run))
            # the finished run extended by two steps: its last step queued nothing ahead, so
            # the resumed one tops up both batches (it stopped at step 5: "0 prompts in flight")
            longer = {"trainer.resume_mode": at, "trainer.total_training_steps": STEPS + 2}
            assert sorted(_fit(_config(data, tmp_path / "longer", **longer))) == [4, 5]
