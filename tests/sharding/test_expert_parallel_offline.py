"""Expert parallelism in the offline trainers: an SFT and a DPO step of a tiny MoE model on
mesh.train data 2 × expert 2 × fsdp 2 (8 CPU devices), run through `loop.on_mesh` as
`train_and_export` runs them, equal the unpartitioned step on one device within 1e-5 (metrics
and gradients), and the program runs the experts in `shard_map`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.offline import loop
from hybridjax.offline.dpo import TRL_METRIC_NAMES, DPOConfig, DPOObjective
from hybridjax.offline.sft import SFT_METRIC_NAMES, sft_objective
from hybridjax.sharding import ACTOR_TRAIN_RULES, MeshConfig, make_meshes, state_shardings
from hybridjax.sharding.roles import batch_sharding
from hybridjax.training.build import init_sharded_train_state, init_train_state
from hybridjax.training.optim import OptimConfig

MOE = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, family="qwen3_moe", num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=(1,),
)  # fmt: skip
OPTIM = OptimConfig(lr=1e-2, warmup_steps=0, total_steps=1)


@pytest.fixture(scope="module")
def model():
    """The tiny MoE (layer 0 routed) with N(0, 0.2²) weights, so routing is far from uniform."""
    graphdef, params = nnx.split(CausalLM(MOE, nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    spread = lambda x: jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype) if x.ndim > 1 else x
    return graphdef, jax.tree.map(spread, params)


def _rows(n: int = 8, t: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    lengths = rng.integers(4, t + 1, n)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.int32)
    loss = mask * (np.arange(t)[None] >= 2)  # the first two tokens are the prompt
    ids = rng.integers(1, MOE.vocab_size, (n, t)) * mask
    return {"input_ids": ids.astype(np.int32), "attention_mask": mask, "loss_mask": loss}


def _both_steps(model, objective, names, rows):
    """(one-device metrics and gradients, expert-parallel ones, the latter's lowered step)."""
    graphdef, params = model
    grad = jax.jit(jax.grad(lambda p, b: objective(graphdef, p, b)[0]))
    state = init_train_state(params, OPTIM)
    one = loop.train_step(graphdef, OPTIM, objective, names, state, rows)[1], grad(params, rows)
    mesh = make_meshes(MeshConfig(train=(2, 2, 2, 1), generate=(-1, 1))).train
    sharded = jax.device_put(params, state_shardings(params, mesh, ACTOR_TRAIN_RULES))
    gate = [v for p, v in nnx.to_flat_state(sharded) if p[-1] == "gate_proj"][0]
    assert gate.get_value().sharding.spec[0] == ("expert", "fsdp")
    batch = loop.place(rows, batch_sharding(mesh))
    grads = loop.on_mesh(mesh, grad)(sharded, batch)
    state = init_sharded_train_state(sharded, OPTIM)
    lowered = loop.on_mesh(mesh, loop.train_step.lower)(
        graphdef, OPTIM, objective, names, state, batch
    )
    step = loop.on_mesh(mesh, loop.train_step)
    return one, (step(graphdef, OPTIM, objective, names, state, batch)[1], grads), lowered


def _assert_equal(one, ep, lowered, names):
    """The step's metrics and the objective's gradient within 1e-5 (the gradient rather than
    the parameters after the step: Adam's first step is lr · g/(|g| + ε) per element, which
    turns rounding of a near-zero gradient into a change of up to lr)."""
    (ref_metrics, ref_grads), (metrics, grads) = one, ep
    for name in names:
        assert float(metrics[name]) == pytest.approx(float(ref_metrics[name]), abs=1e-5), name
    assert float(ref_metrics[names[2]]) > 1e-3  # a real gradient
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert 'manual_axes={"data", "expert", "fsdp", "tensor"}' in lowered.as_text()


def test_expert_parallel_sft_step_equals_one_device(model):
    rows = _rows()
    one, ep, lowered = _both_steps(model, sft_objective, SFT_METRIC_NAMES, rows)
    _assert_equal(one, ep, lowered, SFT_METRIC_NAMES)


def test_expert_parallel_dpo_step_equals_one_device(model):
    """4 pairs as 8 rows (chosen, then rejected) with made-up reference log-probs."""
    rows = _rows() | {"ref_logps": np.linspace(-30.0, -20.0, 8).astype(np.float32)}
    objective = DPOObjective(DPOConfig(beta=0.1))
    one, ep, lowered = _both_steps(model, objective, TRL_METRIC_NAMES, rows)
    _assert_equal(one, ep, lowered, TRL_METRIC_NAMES)
    for name in ("rewards/chosen", "rewards/accuracies", "logps/rejected"):
        assert float(ep[0][name]) == pytest.approx(float(one[0][name]), abs=1e-5), name
