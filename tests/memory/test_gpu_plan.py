"""The GPU stand-in without a GPU: both 7B recipes at 0.5B shapes (small batches), every
program of their step compiled by XLA:GPU for 8 compile-only H100s (`plan --target=h100`):
each stage's peak from XLA:GPU's bytes is within 1.1 × the hand count, the engine's
prefill/extend/decode compile with the decode kernel the engine selects for a GPU, and no
update returns its state resharded. Skipped without JAX's CUDA plugin (`hybridjax[gpu-aot]`)."""

import pytest

from hybridjax.memory import gpu_targets
from hybridjax.memory import planner as plan
from hybridjax.training import build
from tests.memory.test_recipes import _recipe
from tests.rl.tiny_run import REPO

pytestmark = pytest.mark.slow
QWEN_05B = str(REPO / "configs" / "models" / "qwen2.5-0.5b-instruct")


def _small(name: str):
    c = _recipe(name)
    c.actor_rollout_ref.model.path = QWEN_05B
    if c.reward_model.enable:
        c.reward_model.model.path = QWEN_05B
        c.reward_model.micro_batch_size_per_gpu = 2
    a = c.actor_rollout_ref
    c.data.train_batch_size = a.actor.ppo_mini_batch_size = c.critic.ppo_mini_batch_size = 16
    a.rollout.n = 1
    a.actor.ppo_micro_batch_size_per_gpu = c.critic.ppo_micro_batch_size_per_gpu = 2
    a.rollout.log_prob_micro_batch_size_per_gpu = a.ref.log_prob_micro_batch_size_per_gpu = 2
    c.data.max_prompt_length = a.rollout.prompt_length = 64
    c.data.max_response_length = a.rollout.response_length = 64
    a.rollout.max_num_seqs = 8
    a.rollout.num_pages = 64
    return c


@pytest.mark.parametrize("name", ["gpu_grpo_qwen2_7b", "gpu_ppo_qwen2_7b_rm"])
def test_a_step_compiled_for_h100s_stays_within_its_plan(name):
    if problem := gpu_targets.missing_plugin("h100"):
        pytest.skip(problem)
    c = _small(name)
    actor = build.actor_model_config(c, tokenizer=None)
    devices = gpu_targets.compile_only_devices("h100", 8)
    p = plan.plan_memory(c, actor, 8, int(72e9), "gpu", device_list=devices)
    counted = {s.name: s.peak for s in p.stages}
    assert set(p.xla_gpu) == set(counted)  # every stage compiled, gen and reshard included
    for stage, xla in p.xla_gpu.items():
        assert 0 < xla["peak"] <= 1.1 * counted[stage], (stage, xla["peak"], counted[stage])
        assert xla.get("resharded_leaves", 0) == 0, stage
    gen = p.xla_gpu["gen"]
    assert {"prefill peak", "extend peak", "decode peak"} <= set(gen)
    assert gen["aliased"] > 0  # the KV pools are donated and written in place
    if name == "gpu_ppo_qwen2_7b_rm":
        assert {"reward", "values", "update_critic"} <= set(p.xla_gpu)
