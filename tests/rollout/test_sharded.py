"""The engine on the generation mesh of 8 simulated devices (data 4 × tensor 2) gives the
single-device engine's tokens and log-probs."""

import jax
import numpy as np
from jax.sharding import PartitionSpec
from rollout_testing import make_prompts

from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate
from hybridjax.sharding import MeshConfig, make_meshes


def test_sharded_engine_equals_single_device(engine, eos_model):
    assert jax.device_count() == 8
    mesh = make_meshes(MeshConfig(generate=(4, 2))).generate
    # 8 pages per replica: a group fits (at most 8 pages), three running sequences of up to 5
    # pages do not, so replicas preempt (pages on demand) and must still give the same samples.
    config = RolloutConfig(
        page_size=4,
        num_pages=8,
        max_num_seqs=8,
        prompt_length=16,
        response_length=8,
        decode_steps_per_call=4,
    )
    sharded = Engine(eos_model, config, mesh=mesh)
    assert sharded.k_pools[0].sharding.spec == PartitionSpec("tensor", "data")
    q_proj = sharded.state["model"]["layers"][0]["self_attn"]["q_proj"]
    assert "tensor" in jax.tree.leaves(q_proj)[0].sharding.spec

    prompts = make_prompts()
    for sp in (
        SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(n=2, temperature=0.8, top_p=0.9, max_tokens=8, seed=4),
    ):
        # Token streams depend only on (seed, prompt, sample, step), so engines with other slot
        # counts and chunk sizes must agree.
        want = generate(engine, prompts, sp)
        got = generate(sharded, prompts, sp)
        np.testing.assert_array_equal(got.responses, want.responses)
        np.testing.assert_array_equal(got.response_mask, want.response_mask)
        np.testing.assert_allclose(got.rollout_log_probs, want.rollout_log_probs, atol=1e-5)
        assert got.finish_reason == want.finish_reason
    assert sharded.num_preemptions > 0
    assert sharded.num_free_pages == sharded.replicas * sharded.num_pages
