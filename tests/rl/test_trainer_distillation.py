"""On-policy distillation end to end: `configs/quickstart_distill.py` through the trainer on 8
CPU devices, a teacher different from the student, the reverse KL falling over four steps."""

from __future__ import annotations

import math

import pytest

from hybridjax.rl.trainer import RLTrainer
from tests.rl.tiny_run import load_config_file, read_metrics

pytestmark = pytest.mark.slow


def test_reverse_kl_to_a_different_teacher_falls(tmp_path):
    """The student is the quick start's SFT model (peaked, entropy ≈ 0.1 nats), the teacher a
    random 5-layer model of its width (near uniform over 1,000 tokens): the reverse KL starts
    near log 1000 − H and the per-token advantage −k1 pushes the student towards the teacher
    (the opposite pairing, a random student and the trained teacher, learns the same way but
    needs more steps than a test affords)."""
    c = load_config_file("quickstart_distill")
    d = c.actor_rollout_ref.distillation
    c.actor_rollout_ref.model.path, d.teacher_model.path = d.teacher_model.path, ""
    c.actor_rollout_ref.model.override_config = {}
    d.teacher_model.override_config = {"num_hidden_layers": 5}
    c.update_from_flattened_dict({
        "trainer.total_training_steps": 4, "trainer.test_freq": -1,
        "trainer.val_before_train": False, "trainer.default_local_dir": str(tmp_path),
        "trainer.logger": ("jsonl",), "trainer.progress_bar": False,
        "data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
    })  # fmt: skip
    trainer = RLTrainer(c)
    trainer.fit()
    trainer.close()
    metrics = read_metrics(tmp_path)
    kl = [metrics[s]["distill/reverse_kl"] for s in (1, 2, 3, 4)]
    assert all(math.isfinite(v) for v in kl)
    assert "timing_s/teacher" in metrics[1] and "timing_s/old_log_prob" in metrics[1]
    assert kl[0] > 5.0  # a peaked student against a near-uniform teacher
    assert kl[3] < kl[0] - 1.0, kl
    assert metrics[4]["actor/entropy"] > metrics[1]["actor/entropy"]
