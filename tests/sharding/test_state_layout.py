"""Updates return their state in its input's shardings, so the donated buffers are reused:
checked on 8 simulated CPU devices, and on 8 compile-only H100s with XLA:GPU (which, left to
itself, returned the PPO critic's new state replicated) where JAX's CUDA plugin is installed."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from configs.tiny import get_config
from hybridjax.memory import gpu_targets
from hybridjax.memory import planner as plan
from hybridjax.memory.xla_gpu import memory_of, resharded_leaves
from hybridjax.models.decoder import CausalLM
from hybridjax.offline import loop
from hybridjax.offline.dpo import DPOConfig, DPOObjective
from hybridjax.offline.sft import SFT_METRIC_NAMES, sft_objective
from hybridjax.sharding import ACTOR_TRAIN_RULES, BATCH_AXES, make_meshes
from hybridjax.sharding.layout import jit_keeping_state
from hybridjax.sharding.mesh import MeshConfig, pass_mesh
from hybridjax.training import build
from hybridjax.training.optim import OptimConfig


def _mesh(devices):
    return make_meshes(MeshConfig(), devices).train  # fsdp over every device


def _check(compiled, state):
    """No returned state leaf resharded, and (nearly) all of the donated state aliased."""
    assert resharded_leaves(compiled, state) == []
    assert memory_of(compiled)["aliased"] >= 0.99 * plan.device_bytes(state)


def test_a_pinned_update_keeps_a_layout_xla_would_drop():
    mesh = _mesh(jax.devices()[:8])
    sharded = NamedSharding(mesh, PartitionSpec("fsdp"))
    state = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=sharded)
    # the new state does not depend on the old one's layout: XLA is free to replicate it
    update = lambda s: (jnp.zeros_like(s) + s.sum(), s.mean())
    plain = jax.jit(update, donate_argnums=0).lower(state).compile()
    assert resharded_leaves(plain, state) == [""]  # the one leaf, replicated
    pinned = jit_keeping_state(lambda _, s: update(s), static_argnums=(0,), state_argnum=1)
    _check(pinned.lower(None, state).compile(), state)


def _offline_updates(devices):
    """(name, jitted step, args) of SFT's and DPO's `loop.train_step` over an fsdp mesh."""
    c = get_config()
    model = build.actor_model_config(c, build.load_tokenizer(c))
    mesh = _mesh(devices)
    graphdef, params = plan.abstract_model(CausalLM, model, mesh, ACTOR_TRAIN_RULES)
    optim = OptimConfig(lr=1e-5, warmup_steps=0, total_steps=10)
    state = plan.abstract_train_state(params, optim)
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    spec = lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype, sharding=rows)
    sft = {k: spec(jnp.int32, 8, 16) for k in ("input_ids", "attention_mask")}
    sft["loss_mask"] = spec(jnp.float32, 8, 16)
    dpo = sft | {"ref_logps": spec(jnp.float32, 8)}
    yield "sft", (graphdef, optim, sft_objective, SFT_METRIC_NAMES, state, sft), mesh
    names = ("loss", "lr", "grad_norm")
    yield "dpo", (graphdef, optim, DPOObjective(DPOConfig()), names, state, dpo), mesh


@pytest.mark.parametrize("name", ["sft", "dpo"])
def test_offline_steps_keep_their_state_sharded_on_cpu(name):
    args, mesh = next((a, m) for n, a, m in _offline_updates(jax.devices()[:8]) if n == name)
    with pass_mesh(mesh):
        _check(loop.train_step.lower(*args).compile(), args[4])


def _h100s():
    if problem := gpu_targets.missing_plugin("h100"):
        pytest.skip(problem)
    return gpu_targets.compile_only_devices("h100", 8)


def _ppo(lora_rank: int):
    c = get_config()  # PPO with a critic
    c.actor_rollout_ref.model.lora_rank = lora_rank
    c.actor_rollout_ref.rollout.num_pages = 16
    c.mesh.train = dict(data=1, fsdp=8, tensor=1)
    c.mesh.generate = dict(data=4, tensor=2)
    c.data.train_batch_size = c.actor_rollout_ref.actor.ppo_mini_batch_size = 8
    c.critic.ppo_mini_batch_size = 8
    return c


@pytest.mark.slow
def test_lora_actor_and_critic_updates_keep_their_state_sharded_on_xla_gpu():
    """Without the pin, XLA:GPU returns this critic's state replicated (48 of its leaves,
    6.9 KB of 1.66 MB aliased); full-rank updates: tests/memory/test_gpu_plan.py."""
    devices = _h100s()
    c = _ppo(lora_rank=4)
    actor = build.actor_model_config(c, build.load_tokenizer(c))
    p = plan.plan_memory(c, actor, 8, 80 * 10**9, "gpu", device_list=devices)
    stages = {s.name: s.consumers for s in p.stages}
    for role in ("actor", "critic"):  # the planner compiles them as rl.step jits them
        name = f"update_{role}"
        xla, states = p.xla_gpu[name], stages[name]
        assert xla["resharded_leaves"] == 0, name
        donated = states[f"{role} params"] + states[f"{role} optimizer state"]
        assert xla["aliased"] >= 0.99 * donated, name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft", "dpo"])
def test_offline_steps_keep_their_state_sharded_on_xla_gpu(name):
    args, mesh = next((a, m) for n, a, m in _offline_updates(_h100s()) if n == name)
    with pass_mesh(mesh):
        _check(loop.train_step.lower(*args).compile(), args[4])
