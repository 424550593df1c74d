"""The routed MoE layer: grouped matmul against a dense loop over experts, expert parallelism on
8 simulated devices against one device (forward and gradients), routing replay."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.models.moe import MoEMLP, route, with_router_stats

CONFIG = ModelConfig(
    family="qwen3_moe",
    hidden_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=12,
    norm_topk_prob=True,
)


def _layer_and_input(seed=0, b=4, t=6):
    layer = MoEMLP(CONFIG, nnx.Rngs(seed), std=0.3)
    x = jnp.asarray(np.random.default_rng(seed).normal(size=(b, t, 16)), jnp.float32)
    return layer, x


def _dense_reference(layer, x_BxTxD):
    """Every expert on every token, weighted by the router's top-k (zero elsewhere)."""
    x = x_BxTxD.reshape(-1, x_BxTxD.shape[-1])
    w, ids, _ = route(x @ layer.gate[...].T, 2, True)
    e = layer.experts
    h = jax.nn.silu(jnp.einsum("nd,edf->enf", x, e.gate_proj[...]))
    h = h * jnp.einsum("nd,edf->enf", x, e.up_proj[...])
    y_all = jnp.einsum("enf,efd->end", h, e.down_proj[...])
    weight = jnp.zeros((x.shape[0], 8)).at[jnp.arange(x.shape[0])[:, None], ids].set(w)
    return jnp.einsum("ne,end->nd", weight, y_all).reshape(x_BxTxD.shape)


def test_grouped_matmul_equals_dense_loop():
    layer, x = _layer_and_input()
    np.testing.assert_allclose(
        np.asarray(layer(x)), np.asarray(_dense_reference(layer, x)), atol=1e-6
    )


def _loss(layer, x):
    return jnp.sum(jnp.sin(layer(x)) * jnp.cos(x))


_value_and_grad = nnx.jit(nnx.value_and_grad(_loss, argnums=(0, 1)))


@pytest.mark.parametrize(
    "axes, shape",
    [(("data", "expert"), (2, 4)), (("expert", "fsdp", "tensor"), (2, 2, 2))],
    ids=["expert4xdata2", "expert2xfsdp2xtensor2"],
)
def test_expert_parallel_equals_single_device(axes, shape):
    layer, x = _layer_and_input(b=3, t=5)  # 15 tokens: padded to the token shards
    want_y = layer(x)
    want_loss, (want_grads, want_dx) = _value_and_grad(layer, x)
    mesh = Mesh(
        np.array(jax.devices()[:8]).reshape(shape), axes, axis_types=(AxisType.Auto,) * len(axes)
    )
    weights = {
        "gate_proj": P("expert", None, "tensor" if "tensor" in axes else None),
        "up_proj": P("expert", None, "tensor" if "tensor" in axes else None),
        "down_proj": P("expert", "tensor" if "tensor" in axes else None, None),
    }
    for name, spec in weights.items():
        var = getattr(layer.experts, name)
        var.set_value(jax.device_put(var.get_value(), NamedSharding(mesh, spec)))
    with jax.set_mesh(mesh):
        lowered = _value_and_grad.lower(layer, x).compile().as_text()
        loss, (grads, dx) = _value_and_grad(layer, x)
        y = jax.jit(lambda m, x: m(x))(layer, x)
    assert "all-gather" in lowered and "reduce-scatter" in lowered  # ran expert-parallel
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), atol=1e-5)
    np.testing.assert_allclose(float(loss), float(want_loss), atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(want_dx), atol=1e-5)
    want, got = nnx.to_flat_state(want_grads), dict(nnx.to_flat_state(grads))
    for path, g in want:
        np.testing.assert_allclose(
            np.asarray(got[path].get_value()),
            np.asarray(g.get_value()),
            atol=1e-5,
            err_msg=str(path),
        )


def test_expert_axis_must_divide_experts():
    layer, x = _layer_and_input()
    mesh = Mesh(np.array(jax.devices()[:3]), ("expert",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="num_experts=8"):
        jax.jit(lambda x: layer(x))(x)


def test_replayed_experts_are_used():
    """With the router's own choice replayed the output is unchanged; with other experts the
    output is those experts' mix, weighted by the router's (renormalised) probabilities."""
    layer, x = _layer_and_input()
    _, ids, probs = route(x.reshape(-1, 16) @ layer.gate[...].T, 2, True)
    same = layer(x, replay_ids_BxTxK=ids.reshape(4, 6, 2))
    np.testing.assert_allclose(np.asarray(same), np.asarray(layer(x)), atol=1e-6)
    other = (ids + 3) % 8
    got = layer(x, replay_ids_BxTxK=other.reshape(4, 6, 2))
    single = MoEMLP(CONFIG.__class__(**{**CONFIG.__dict__, "num_experts_per_tok": 1}), nnx.Rngs(0))
    nnx.update(single, nnx.state(layer))
    top = jnp.take_along_axis(probs, other, -1)
    top = top / top.sum(-1, keepdims=True)
    want = sum(
        top[:, j, None] * single(x, replay_ids_BxTxK=other[:, j].reshape(4, 6, 1)).reshape(-1, 16)
        for j in range(2)
    )
    np.testing.assert_allclose(np.asarray(got).reshape(-1, 16), np.asarray(want), atol=1e-5)


def test_router_stats_with_gradient_checkpointing():
    """`remat` runs each layer as a copy inside `jax.checkpoint`: its router statistics still
    reach `with_router_stats`, the same as without."""
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 5)), jnp.int32)
    mask = jnp.ones((2, 5), jnp.int32).at[1, :2].set(0)
    forward = nnx.jit(with_router_stats(lambda model, i, m: model(i, m)))
    stats = []
    for remat in (False, True):
        config = dataclasses.replace(
            CONFIG, vocab_size=64, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, remat=remat,
        )  # fmt: skip
        stats.append(forward(CausalLM(config, nnx.Rngs(0)), ids, mask)[1])
    np.testing.assert_allclose(stats[1].expert_load, stats[0].expert_load)
    np.testing.assert_allclose(float(stats[1].aux_loss()), float(stats[0].aux_loss()), rtol=1e-6)
    assert float(stats[1].rows[0]) == 8.0


def test_negative_replay_ids_keep_the_router_choice():
    layer, x = _layer_and_input()
    ids = route(x.reshape(-1, 16) @ layer.gate[...].T, 2, True)[1].reshape(4, 6, 2)
    other = (ids + 1) % 8
    replayed = layer(x, replay_ids_BxTxK=other)
    mixed = layer(x, replay_ids_BxTxK=other.at[0].set(-1))  # row 0 not recorded
    np.testing.assert_allclose(np.asarray(mixed[0]), np.asarray(layer(x)[0]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(mixed[1:]), np.asarray(replayed[1:]), atol=1e-6)
