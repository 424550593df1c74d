"""On-policy distillation on the quick start's arithmetic task: a small random student learns
from the shipped warm start (`hybridjax/assets/quickstart/sft_model`, 4 layers, width 256,
3.4M parameters) as its teacher, with no task reward.

    python -m hybridjax.train --config=configs/quickstart_distill.py

How it differs from the quick start's GRPO (`configs/quickstart.py`): the student samples
`rollout.n` = 8 responses per prompt as in GRPO, the teacher scores every sampled token in the
`teacher` stage (the reference pass's packed, shared-prompt forward), and each token's
advantage is −(log π_student(y_t) − log π_teacher(y_t)), the per-token reverse KL with
discount 0 (Thinking Machines' on-policy distillation; TRL GKD with lmbda = 1, beta = 1),
instead of a group-normalised outcome score: `distillation.use_policy_loss` False drops the
task advantage (set it True, with `distillation_loss_coef`, to mix both). The update is the
usual PPO-clip loss on these advantages; π_old comes from the `old_log_prob` pass (the adv
stage reads it). The metric to watch is `distill/reverse_kl` (nats per token), beside the
rule reward `critic/score/mean`, which is still computed and logged.
Student: 2 layers, width 128, the teacher's tokenizer (vocabulary 1,000), random init.

Measured (1 CPU device, 2-core machine shared with other jobs; 12 steps, 81 s wall with the
compiles): `distill/reverse_kl` 5.45 → 5.17 nats per token, the student's entropy 6.88 → 6.85
(near uniform, log 1000 = 6.91). A random student moves slowly at this lr. The student's
accuracy before and after distillation, against GRPO from the same (fine-tuned, smaller)
student with the same steps, is measured by `experiments/examples/distill_arithmetic.py`
(which takes this config's distillation keys; see docs/algorithms.md). The top-k variant:
`--config.actor_rollout_ref.distillation.loss_mode=forward_kl_topk
--config.actor_rollout_ref.distillation.topk=32`.
"""

import os

from hybridjax.user_code import load_module

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
    quickstart = load_module(os.path.join(HERE, "quickstart.py"))
    c = quickstart.get_config()
    a = c.actor_rollout_ref
    teacher = os.path.join(quickstart.ASSETS, "sft_model")
    a.model.path = ""  # a random student ...
    c.data.tokenizer = teacher  # ... with the teacher's tokenizer
    a.model.override_config = dict(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    a.actor.optim.lr = 1e-3
    d = a.distillation
    d.enabled = True
    d.loss_mode = "reward"
    d.distillation_loss_coef = 1.0
    d.use_policy_loss = False
    d.teacher_model.path = teacher
    c.trainer.experiment_name = "quickstart_distill"
    c.trainer.default_local_dir = "checkpoints/hybridjax/quickstart_distill"
    return c
