"""The distillation experiment's student runs: the same config but for the distillation keys."""

import pytest

from experiments.examples.distill_arithmetic import rl_config
from hybridjax.errors import ConfigError
from hybridjax.rl.checks import validate


def test_student_runs_differ_only_in_the_distillation_keys():
    grpo = rl_config("student_dir", steps=7, lr=3e-4, seed=2)
    distill = rl_config("student_dir", steps=7, lr=3e-4, seed=2, teacher="teacher_dir")
    top = rl_config("student_dir", steps=7, lr=3e-4, seed=2, teacher="teacher_dir", topk=16)
    for c in (grpo, distill, top):
        validate(c, 1)  # keys, types, and the topk / loss_mode pairing
        assert c.actor_rollout_ref.model.path == "student_dir"
        assert c.actor_rollout_ref.actor.optim.lr == 3e-4
        assert (c.trainer.total_training_steps, c.trainer.seed) == (7, 2)
    assert not grpo.actor_rollout_ref.distillation.enabled
    d = distill.actor_rollout_ref.distillation
    assert d.enabled and d.loss_mode == "reward" and not d.use_policy_loss
    assert d.teacher_model.path == "teacher_dir" and d.topk == 0
    t = top.actor_rollout_ref.distillation
    assert (t.loss_mode, t.topk) == ("forward_kl_topk", 16)
    flat = lambda c: (
        {k: v for k, v in c.to_dict().items() if k != "actor_rollout_ref"}
        | {k: v for k, v in c.actor_rollout_ref.to_dict().items() if k != "distillation"}
    )
    assert flat(grpo) == flat(distill) == flat(top)
    top.actor_rollout_ref.distillation.loss_mode = "reward"  # topk without its reader
    with pytest.raises(ConfigError, match="distillation.topk=16 with loss_mode='reward'"):
        validate(top, 1)
