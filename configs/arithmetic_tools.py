"""GRPO with a calculator tool on arithmetic word problems: a CPU experiment on whether tool use
can be learned (multi-turn rollouts, `rollout.multi_turn`).

    python -m hybridjax.data.arithmetic_tools --output data/tools_always --tool_p 1 --sloppy_p 0
    python -m hybridjax.data.arithmetic_tools --output data/arithmetic_tools
    python -m hybridjax.sft --config=configs/sft_arithmetic_tools.py \
        --config.data.train_files=data/tools_always/sft.parquet \
        --config.trainer.total_training_steps=500 \
        --config.trainer.output_dir=data/tools_always/sft_model
    python -m hybridjax.sft --config=configs/sft_arithmetic_tools.py \
        --config.model.path=data/tools_always/sft_model \
        --config.trainer.output_dir=data/arithmetic_tools/sft_model
    python -m hybridjax.train --config=configs/arithmetic_tools.py

(`python -m experiments.examples.tool_arithmetic` runs these and measures the model before and
after GRPO.) Task (`hybridjax.data.arithmetic_tools`): half the problems are the quick start's,
half multiply two 2-digit numbers, which the 3.4M-parameter model cannot do in its head. The
warm start learns from its teachers how to write a call and to answer with the tool's result
(500 steps on a teacher that always calls), then to call only sometimes, and sometimes as
`37 x 24`, which the calculator rejects (60 steps on the default teacher: `tool_p` 0.3,
`sloppy_p` 0.3). The reward is GSM8K's strict rule on the whole trajectory's text; nothing
rewards tool use itself. README ("Can tool use be learned on a CPU?") has the measured runs.

As `configs/quickstart.py` (GRPO, n = 8, 16 prompts per step, no KL, one on-policy update per
step; lr 5e-5, as the quick start), plus `rollout.multi_turn` with
`configs/tools/calculator.yaml`: at most 2 assistant turns (a call, then the answer),
`response_length` 128 for model and tool tokens (the longest trajectory, with a failed call, is
116 tokens). The prompts do not show the tool's schema (the model has 256 positions); the warm
start learned the call format from its teacher.
"""

import os

from hybridjax.config.schema import base_config

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
    c = base_config()
    c.data.train_files = "data/arithmetic_tools/train.parquet"
    c.data.val_files = "data/arithmetic_tools/test.parquet"
    c.data.max_prompt_length = 32
    c.data.max_response_length = 128
    c.data.train_batch_size = 16
    c.data.val_batch_size = 256

    a = c.actor_rollout_ref
    a.model.path = "data/arithmetic_tools/sft_model"
    a.actor.optim.lr = 5e-5
    a.actor.optim.weight_decay = 0.0
    a.actor.ppo_mini_batch_size = 16
    a.actor.ppo_micro_batch_size_per_gpu = 128
    a.actor.use_kl_loss = False
    a.rollout.n = 8
    a.rollout.temperature = 1.0
    a.rollout.prompt_length = 32
    a.rollout.response_length = 128
    a.rollout.max_num_seqs = 256
    a.rollout.log_prob_micro_batch_size_per_gpu = 128
    a.rollout.decode_steps_per_call = 16
    a.rollout.min_prefill_bucket = 32
    mt = a.rollout.multi_turn
    mt.enable = True
    mt.tool_config_path = os.path.join(HERE, "tools", "calculator.yaml")
    mt.max_assistant_turns = 2
    mt.tool_timeout_s = 10.0

    c.critic.enable = False
    c.algorithm.adv_estimator = "grpo"
    c.algorithm.use_kl_in_reward = False

    t = c.trainer
    t.experiment_name = "arithmetic_tools"
    t.total_training_steps = 30
    t.test_freq = 10
    t.val_before_train = True
    t.save_freq = -1
    t.logger = ("console", "jsonl")
    t.resume_mode = "disable"
    return c
