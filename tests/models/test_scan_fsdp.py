"""Stored stacked layers under FSDP: inside the training passes' mesh context (`pass_mesh`)
a scanned model's backward all-gathers one layer's weights per scan step, never the whole stack
and never the batch's activations (the planner counts one gathered layer,
`hybridjax.memory.counts`)."""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.sharding import ACTOR_TRAIN_RULES, MeshConfig, init_sharded, make_meshes
from hybridjax.sharding.mesh import pass_mesh

L, D, H, HD, F, B, T = 3, 32, 4, 8, 96, 16, 64
CONFIG = ModelConfig(
    vocab_size=64, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
    num_attention_heads=H, num_key_value_heads=2, tie_word_embeddings=True,
    scan_layers=True, remat=True,
)  # fmt: skip


def _all_gathers(context) -> list[str]:
    """Result shapes (e.g. 'f32[32,4,8]') of the all-gathers in the partitioned gradient of a
    scanned model's mean logit over B × T tokens split over fsdp 8, compiled under `context`."""
    mesh = make_meshes(MeshConfig(train=(1, 1, 8, 1), generate=(8, 1))).train
    graphdef, params = nnx.split(init_sharded(CausalLM, CONFIG, mesh, ACTOR_TRAIN_RULES, 0))
    assert "fsdp" in str(params["model"]["layers"]["self_attn"]["q_proj"][...].sharding.spec)
    ids = jax.device_put(jnp.ones((B, T), jnp.int32), NamedSharding(mesh, PartitionSpec("fsdp")))
    loss = lambda p, ids: nnx.merge(graphdef, p)(ids, jnp.ones_like(ids)).mean()
    with context(mesh):
        hlo = str(jax.jit(jax.grad(loss)).lower(params, ids).compile().as_text())
    return re.findall(r"= \(?([a-z0-9]+\[[0-9,]*\])[^\n]*? all-gather(?:-start)?\(", hlo)


def test_scanned_layers_gather_one_layer_of_weights_per_step():
    gathered = _all_gathers(pass_mesh)
    # q_proj (D, H, Dh) and down_proj (F, D) of one layer, gathered over fsdp
    assert {f"f32[{D},{H},{HD}]", f"f32[{F},{D}]"} <= set(gathered), gathered
    assert not [s for s in gathered if s.startswith(f"f32[{L},")], gathered  # no stack
    assert not [s for s in gathered if s.startswith(f"f32[{B},{T}")], gathered  # no rows


def test_without_the_mesh_context_the_partitioner_gathers_the_rows():
    """The check can fail: unpinned, the scan's rows are all-gathered instead."""
    gathered = _all_gathers(lambda mesh: contextlib.nullcontext())
    assert [s for s in gathered if s.startswith(f"f32[{B},{T}")], gathered
