"""GRPO on GSM8K scored by a generative reward model (an LLM judge) instead of the rule.

    python -m hybridjax.train --config=configs/gsm8k_grpo_genrm.py \
        --config.actor_rollout_ref.model.path=/path/to/Qwen2.5-0.5B-Instruct \
        --config.reward_model.model.path=/path/to/Qwen2.5-7B-Instruct

How it differs from `gsm8k_grpo.py` (plain GRPO with verl's rule score): the score of each
response is what the judge (`reward_model.model.path`, any `*ForCausalLM` we load, with its own
tokenizer) writes after the prompt below, read by the `boxed` parser as a number in [0, 1]
(`reward_model.combine=replace`: the rule's `acc` is still reported, not trained on). The judge
sees the reference answer (`{ground_truth}`), so it grades like the rule but can give partial
credit. It decodes greedily, at most 32 verdict tokens, on our paged engine on the rollout's
devices (`placement.reward_model` puts it on a pool of its own); a verdict without a
`\\boxed{}` number scores 0 (`reward_model.on_error=zero`) and counts in
`reward/genrm_parse_failures`. To share one judge between trainers, serve it:

    python -m hybridjax.rewards.serve --port 8002 --judge_path /path/to/Qwen2.5-7B-Instruct \
        --judge_config '{"parser": "boxed", "apply_chat_template": true, "response_length": 32}'
    ... --config.reward_model.model.path= --config.reward_model.remote.urls=http://host:8002

(the server's `--judge_config` takes the `reward_model.generative` keys; give it the template
below too). Data: `python -m hybridjax.data.gsm8k --input tests/assets/gsm8k --output data/gsm8k`.
"""

import os

from hybridjax.user_code import load_module

HERE = os.path.dirname(os.path.abspath(__file__))

TEMPLATE = (
    "You grade answers to grade-school math problems.\n"
    "Problem and student answer:\n{prompt}\n{response}\n\n"
    "Reference final answer: {ground_truth}\n"
    "Reply with 1 if the student's final answer equals the reference, 0 if not, 0.5 if the "
    "reasoning is right but the final number is wrong, as \\boxed{{score}} and nothing else."
)


def _grpo():
    return load_module(os.path.join(HERE, "gsm8k_grpo.py")).get_config()


def get_config():
    c = _grpo()
    rm = c.reward_model
    rm.enable = True
    rm.model.path = ""  # the judge: set with --config.reward_model.model.path=...
    rm.model.dtype = "bfloat16"
    g = rm.generative
    g.enable = True
    g.prompt_template = TEMPLATE
    g.parser = "boxed"
    g.min_score, g.max_score = 0.0, 1.0
    g.apply_chat_template = True
    g.response_length = 32
    g.prompt_length = 1280  # template + 512 prompt + 512 response tokens of the judge
    g.temperature = 0.0
    g.max_num_seqs = 128
    c.trainer.experiment_name = "gsm8k_grpo_genrm"
    c.trainer.default_local_dir = "checkpoints/hybridjax/gsm8k_grpo_genrm"
    return c
