"""The planner's count of a stage's live bytes (`hybridjax.memory.counts`), by hand."""

import dataclasses

import jax
import pytest

from hybridjax.memory.counts import LoopStep, stage_bytes
from hybridjax.memory.planner import abstract_model, device_bytes
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.sharding import ACTOR_TRAIN_RULES, MeshConfig, make_meshes

F32, BF16 = 4, 2
D, F, L, V, H, KV, HD = 64, 128, 2, 256, 4, 2, 16
MODEL = ModelConfig(
    vocab_size=V,
    hidden_size=D,
    intermediate_size=F,
    num_hidden_layers=L,
    num_attention_heads=H,
    num_key_value_heads=KV,
    tie_word_embeddings=True,
)


def _params(model, data, fsdp):
    config = MeshConfig(train=(data, 1, fsdp, 1), generate=(data * fsdp, 1))
    mesh = make_meshes(config, jax.devices()[: data * fsdp]).train
    return abstract_model(CausalLM, model, mesh, ACTOR_TRAIN_RULES)[1], dict(mesh.shape)


def test_update_without_fsdp_or_cast_holds_activations_logits_and_gradients():
    params, shape = _params(MODEL, 2, 1)
    step = LoopStep(tokens=48, head_tokens=40, rows=2, row_length=24)
    big = 2 * 10**7  # AdamW state: trainable parameters of 10 MB, more than the backward holds
    got = stage_bytes("update", MODEL, params, shape, step, "jnp", opt_state_bytes=big)
    # one layer: 6 hidden + 3 MLP vectors, q/k/v/out (2 × (H + KV) heads), 2 rows of H × 24²
    # float32 attention probabilities (all of them backward)
    layer = 48 * (6 * D + 3 * F) * F32 + 48 * 2 * (H + KV) * HD * F32 + 2 * H * 24**2 * F32
    backward = {
        "gathered weights": 0,  # nothing to gather, nothing to cast
        "activations": (L + 1) * layer,  # no remat: every layer's, plus one layer's gradients
        "logits": 40 * V * F32 * 4,
    }
    # the optimizer phase (the update tree: 10 MB) follows the backward and reuses its memory
    assert got == backward | {"gradients": big, "optimizer step": big // 2 - sum(backward.values())}
    small = stage_bytes("update", MODEL, params, shape, step, "jnp", True, 1000)
    assert small == backward | {"gradients": 1000, "optimizer step": 0}
    remat = stage_bytes(
        "update", dataclasses.replace(MODEL, remat=True), params, shape, step, "jnp", True, 1000
    )
    assert remat["activations"] == L * 48 * D * F32 + 2 * layer
    dots = dataclasses.replace(MODEL, remat=True, remat_policy="dots_with_no_batch_dims")
    saved = stage_bytes("update", dots, params, shape, step, "jnp", True, 1000)["activations"]
    # each layer's input, q/k/v ((H + 2 KV) × HD), o_proj and down_proj (D each), gate and up
    kept = D + (H + 2 * KV) * HD + 2 * D + 2 * F
    assert saved == L * 48 * kept * F32 + 2 * layer
    forward = stage_bytes("forward", MODEL, params, shape, step, "fused", with_head=False)
    assert forward == {
        "gathered weights": 0,
        "activations": 48 * (6 * D + 3 * F) * F32 + 48 * 2 * (H + KV) * HD * F32,
        "logits": 40 * F32 * 2,  # a scalar head
    }


def test_fsdp_and_bfloat16_gather_cast_and_hold_the_full_gradient_of_one_layer():
    model = dataclasses.replace(MODEL, dtype="bfloat16")
    params, shape = _params(model, 1, 2)
    full = model.num_params() * F32
    outer = (V * D + D) * F32  # tied embedding, final norm
    one_layer = (full - outer) // L
    step = LoopStep.of(None, micro_rows=2, prompt=16, response=8)
    assert step == LoopStep(tokens=48, head_tokens=16, rows=2, row_length=24)
    forward = stage_bytes("forward", model, params, shape, step, "fused")
    # the float32 copy gathered over fsdp and its bfloat16 cast
    assert forward["gathered weights"] == (one_layer + outer) * (F32 + BF16) // F32
    update = stage_bytes("update", model, params, shape, step, "fused", opt_state_bytes=8)
    # ... plus the weights' bfloat16 gradient and the unsharded float32 one
    assert update["gathered weights"] == (one_layer + outer) * (F32 + 2 * BF16 + F32) // F32
    assert forward["activations"] == 48 * (6 * D + 3 * F) * BF16 + 48 * 2 * (H + KV) * HD * BF16
    # the states themselves are split in two (device_bytes), the gathered copies are not
    assert device_bytes(params) < full


def test_vocab_parallel_head_is_never_gathered():
    """fsdp = 2, the fused head vocab-parallel over it: the tied embedding counts at its shard
    (V/2 × D; the final norm is replicated), and a chunk's 2 × 4 positions' hidden states
    gathered over fsdp (2×) count with the logits, their gradient too in an update."""
    model = dataclasses.replace(MODEL, dtype="bfloat16")
    params, shape = _params(model, 1, 2)
    full = model.num_params() * F32
    outer = (V * D + D) * F32
    one_layer = (full - outer) // L
    step = LoopStep.of(None, micro_rows=2, prompt=16, response=8)
    args = ("fused", True, 0, 4)
    forward = stage_bytes("forward", model, params, shape, step, *args, vocab_axes=("fsdp",))
    gspmd = stage_bytes("forward", model, params, shape, step, *args)
    shard = (V * D // 2 + D) * F32
    assert forward["gathered weights"] == (one_layer + shard) * (F32 + BF16) // F32
    hidden = 2 * 4 * 2 * D * BF16
    assert forward["logits"] == gspmd["logits"] + hidden
    update = stage_bytes("update", model, params, shape, step, *args, vocab_axes=("fsdp",))
    assert update["gathered weights"] == (one_layer + shard) * (F32 + 2 * BF16 + F32) // F32
    assert update["logits"] == 2 * 4 * V * F32 * 3 + 2 * hidden
    unfused = stage_bytes("forward", model, params, shape, step, "fused", vocab_axes=("fsdp",))
    assert unfused["gathered weights"] == gspmd["gathered weights"]  # only the fused head


def test_unknown_kind_is_refused():
    params, shape = _params(MODEL, 2, 1)
    with pytest.raises(ValueError, match="forward|update"):
        stage_bytes("backward", MODEL, params, shape, LoopStep(1, 1, 1, 1), "jnp")


def test_moe_layers_hold_routed_copies_expert_widths_and_router_probabilities():
    moe = dataclasses.replace(
        MODEL,
        family="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        mlp_only_layers=(1,),  # layer 1 dense: the larger of the two counts
    )
    params, shape = _params(moe, 2, 1)
    step = LoopStep(tokens=48, head_tokens=40, rows=2, row_length=24)
    got = stage_bytes("forward", moe, params, shape, step, "fused")
    routed = (2 * 2 * D + 3 * 2 * 24) * F32 + 8 * F32  # 408 floats, more than the dense 384
    assert routed > 3 * F * F32
    assert got["activations"] == 48 * (6 * D * F32 + routed) + 48 * 2 * (H + KV) * HD * F32
    dense_only = dataclasses.replace(moe, moe_intermediate_size=1, num_experts_per_tok=1)
    got = stage_bytes("forward", dense_only, params, shape, step, "fused")
    assert got["activations"] == 48 * (6 * D + 3 * F) * F32 + 48 * 2 * (H + KV) * HD * F32


def test_fused_head_holds_one_chunk_of_logits():
    """2 rows × 40 head positions in chunks of 16: 2 × 16 positions of float32 logits, 2
    copies forward and 3 in an update; a chunk longer than the rows is the rows' length."""
    params, shape = _params(MODEL, 2, 1)
    step = LoopStep(tokens=96, head_tokens=80, rows=2, row_length=48)
    forward = stage_bytes("forward", MODEL, params, shape, step, "fused", head_chunk=16)
    assert forward["logits"] == 2 * 16 * V * F32 * 2
    update = stage_bytes("update", MODEL, params, shape, step, "fused", True, 8, head_chunk=16)
    assert update["logits"] == 2 * 16 * V * F32 * 3
    whole = stage_bytes("forward", MODEL, params, shape, step, "fused", head_chunk=256)
    assert whole["logits"] == 80 * V * F32 * 2


@pytest.mark.parametrize("fsdp", [1, 2])
def test_stacked_layers_count_as_the_per_layer_model(fsdp):
    """A scanned model's stacked layer weights (`scan_layers`) count as L layers: the same
    per-layer gathered weights and activations as the per-layer model's."""
    step = LoopStep(tokens=48, head_tokens=40, rows=2, row_length=24)
    model = dataclasses.replace(MODEL, dtype="bfloat16")
    counts = {}
    for scan in (False, True):
        config = dataclasses.replace(model, scan_layers=scan)
        params, shape = _params(config, 1, fsdp)
        counts[scan] = stage_bytes("update", config, params, shape, step, "fused", True, 8)
    assert counts[True] == counts[False]
    assert counts[True]["gathered weights"] > 0
