"""GRPO on GSM8K with a calculator tool (verl's multi-turn GSM8K recipe, with the calculator):
the model may write `<tool_call>{"name": "calculator", ...}</tool_call>`, the call runs on the
host, its result is appended as a tool message (masked from the loss), and generation goes on.

    python -m hybridjax.data.gsm8k --input tests/assets/gsm8k --output data/gsm8k_tool --multi-turn
    python -m hybridjax.train --config=configs/gsm8k_multiturn.py \
        --config.actor_rollout_ref.model.path=/path/to/Qwen2.5-0.5B-Instruct

As `gsm8k_grpo.py`, plus `rollout.multi_turn` (up to 5 assistant turns, tool responses cut to
256 characters); `response_length` bounds the whole trajectory, tool tokens included. Metrics:
`multi_turn/num_turns_mean|max`, `multi_turn/tool_calls`, `multi_turn/tool_errors`.
"""

import os

from hybridjax.user_code import load_module

HERE = os.path.dirname(os.path.abspath(__file__))


def _grpo():
    return load_module(os.path.join(HERE, "gsm8k_grpo.py")).get_config()


def get_config():
    c = _grpo()
    c.data.train_files = "data/gsm8k_tool/train.parquet"
    c.data.val_files = "data/gsm8k_tool/test.parquet"
    c.data.max_prompt_length = 768  # the system message shows the tool schema
    c.actor_rollout_ref.rollout.prompt_length = 768
    c.actor_rollout_ref.rollout.response_length = 1024  # model + tool tokens
    c.data.max_response_length = 1024
    mt = c.actor_rollout_ref.rollout.multi_turn
    mt.enable = True
    mt.tool_config_path = os.path.join(HERE, "tools", "calculator.yaml")
    mt.max_assistant_turns = 5
    mt.max_tool_response_length = 256
    c.trainer.experiment_name = "gsm8k_multiturn_calculator"
    return c
