"""The vocab-parallel fused head (`LogProbConfig.mesh`, `hybridjax.models.logprobs`).

Numerics: on 8 simulated devices (data × fsdp × tensor meshes), log-probs, entropy and their
gradients (hidden states and head, tied and untied) equal the full-logit path on one device
(float32, 1e-5). HLO: the partitioned actor update and old-log-prob pass of a tiny model on
data × fsdp × tensor = 1 × 4 × 2 hold no collective of the LM head's FSDP-gathered D × V/tp
(or full D × V) size, neither an all-gather of the weight nor an all-reduce of its gradient,
and the embedding is never gathered; without the mesh (GSPMD's own choice) they are there.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.models.logprobs import LogProbConfig, token_log_probs, vocab_split
from hybridjax.sharding import ACTOR_TRAIN_RULES, MeshConfig, init_sharded, make_meshes
from hybridjax.training import build
from hybridjax.training import passes as stages
from tests.rl.test_packing import CONFIG, PLAIN, N, P, R, ragged_batch
from tests.rl.tiny_run import load_config_file

TOL = dict(rtol=1e-5, atol=1e-5)
UNFUSED = LogProbConfig(use_fused_kernels=False)
HEAD = ModelConfig(
    vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1,
)  # fmt: skip


def _train_mesh(shape):
    """The training mesh of `shape` = (data, fsdp, tensor), expert 1."""
    data, fsdp, tensor = shape
    return make_meshes(MeshConfig(train=(data, 1, fsdp, tensor), generate=(-1, 2))).train


def test_vocab_split_takes_the_dividing_axes():
    """On 2 × 2 × 2: V = 48 over tensor and fsdp, rows over data; V = 50 over tensor only
    (fsdp does not divide 25), rows over data and fsdp, or data alone for 6 rows; V = 49: no
    split. Axes of size 1 take no part (1 × 4 × 2: no row axis)."""
    mesh = _train_mesh((2, 2, 2))
    assert vocab_split(mesh, 48, 8)[1:] == (("tensor", "fsdp"), ("data",))
    assert vocab_split(mesh, 50, 8)[1:] == (("tensor",), ("data", "fsdp"))
    assert vocab_split(mesh, 50, 6)[1:] == (("tensor",), ("data",))
    assert vocab_split(mesh, 49, 8) is None and vocab_split(None, 48, 8) is None
    assert vocab_split(_train_mesh((1, 4, 2)), 48, 8)[1:] == (("tensor", "fsdp"), ())


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 4, 2)])
def test_vocab_parallel_equals_single_device_full_logits(tie, shape):
    """B = 4 rows of T = 7 positions in chunks of 3, temperature 0.7, a loss weighting every
    position's log-prob and entropy differently: values and gradients of hidden states and
    head equal `log_softmax` of full logits on one device."""
    mesh = _train_mesh(shape)
    config = dataclasses.replace(HEAD, tie_word_embeddings=tie)
    graphdef, params = nnx.split(init_sharded(CausalLM, config, mesh, ACTOR_TRAIN_RULES, seed=0))
    hidden = jax.random.normal(jax.random.key(1), (4, 7, 16))
    targets = jax.random.randint(jax.random.key(2), (4, 7), 0, 48)
    weights = jnp.arange(7.0), jnp.cos(jnp.arange(7.0))

    def loss(params, hidden, head):
        model = nnx.merge(graphdef, params)
        lp, ent = token_log_probs(model, hidden, targets, 0.7, head, True)
        return jnp.sum(lp * weights[0]) + jnp.sum(ent * weights[1]), (lp, ent)

    grad = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True), static_argnums=2)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    head = LogProbConfig(chunk_size=3, mesh=mesh)
    (_, got), got_grads = grad(params, jax.device_put(hidden, rows), head)
    one = jax.devices()[0]
    (_, want), want_grads = grad(jax.device_put(params, one), jax.device_put(hidden, one), UNFUSED)
    for a, b in zip(
        jax.tree.leaves((got, got_grads)), jax.tree.leaves((want, want_grads)), strict=True
    ):
        np.testing.assert_allclose(a, b, **TOL)


# ---------------------------------------------------------- the partitioned HLO of the passes

VOCAB = 97 * 8  # no other dimension of the model is V, V/2 (tensor) or V/8


def _stage_config(mesh):
    """A tiny run's stages for the 1 × 4 × 2 mesh: micro-batches of 2 rows per device."""
    c = load_config_file("tiny")
    c.data.train_batch_size = 4
    c.actor_rollout_ref.rollout.n = N
    c.actor_rollout_ref.actor.ppo_mini_batch_size = 4
    c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 2
    c.actor_rollout_ref.actor.entropy_coeff = 0.01
    c.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 2
    c.actor_rollout_ref.rollout.prompt_length = c.data.max_prompt_length = P
    c.actor_rollout_ref.rollout.response_length = c.data.max_response_length = R
    c.update_from_flattened_dict(PLAIN)
    return build.stage_config(c, total_steps=2, data_parallel=4, mesh=mesh)


@pytest.fixture(scope="module")
def partitioned():
    """(head, pass) → partitioned HLO text of a 1-layer model's actor update and old-log-prob
    pass with the vocab-parallel head (`mesh`), and of the update with GSPMD's own
    partitioning (`gspmd`)."""
    mesh = _train_mesh((1, 4, 2))
    config = dataclasses.replace(CONFIG, vocab_size=VOCAB, num_hidden_layers=1)
    graphdef, params = nnx.split(init_sharded(CausalLM, config, mesh, ACTOR_TRAIN_RULES, seed=0))
    batch, _ = ragged_batch()
    adv = batch.response_mask * 0.5
    batch = batch.replace(advantages=adv, old_log_probs=adv, ref_log_prob=adv)
    batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
    out = {}
    for name, m in (("mesh", mesh), ("gspmd", None)):
        cfg = _stage_config(m)
        state = jax.jit(lambda p, cfg=cfg: build.init_train_state(p, cfg.actor_optim))(params)
        update = lambda s, bt, cfg=cfg: stages.update_actor(graphdef, s, bt, jax.random.key(0), cfg)
        old = lambda p, bt, cfg=cfg: stages.compute_old_log_prob(graphdef, p, bt, cfg)
        out[name, "update_actor"] = jax.jit(update).lower(state, batch).compile().as_text()
        if m is not None:  # GSPMD's old-log-prob pass gathers as its update's forward does
            out[name, "old_log_prob"] = jax.jit(old).lower(params, batch).compile().as_text()
    return out


COLLECTIVE = re.compile(r"= (\(?[a-z0-9]+\[[^\n]*?) (all-gather|all-reduce|reduce-scatter)\(")


def head_sized_collectives(hlo: str) -> list[str]:
    """The all-gathers, all-reduces and reduce-scatters whose result includes an array of the
    head's gathered size: D × V, D × V/2 (split over tensor only) or the transposes."""
    d, v = CONFIG.hidden_size, VOCAB
    sizes = {f"[{a},{b}]" for a, b in ((d, v), (d, v // 2), (v, d), (v // 2, d))}
    found = []
    for match in COLLECTIVE.finditer(hlo):
        shapes = re.findall(r"\[[0-9,]*\]", match.group(1))
        if sizes & set(shapes):
            found.append(f"{match.group(2)} {match.group(1)[:80]}")
    return found


@pytest.mark.slow  # the module's three compiles of the passes: about 40 s on two cores
@pytest.mark.parametrize("stage", ["update_actor", "old_log_prob"])
def test_no_collective_of_the_gathered_head(partitioned, stage):
    """With the mesh: no all-gather of the head's D × V/tp weight and no all-reduce of its
    gradient."""
    assert head_sized_collectives(partitioned["mesh", stage]) == []


@pytest.mark.slow
def test_gspmd_alone_gathers_the_head_and_reduces_its_full_gradient(partitioned):
    """Without the mesh (the check can fail): GSPMD all-gathers the FSDP-stored head to
    D × V/tp and all-reduces its D × V/tp gradient in the update."""
    gspmd = head_sized_collectives(partitioned["gspmd", "update_actor"])
    assert any(c.startswith("all-gather") for c in gspmd), gspmd
    assert any(c.startswith("all-reduce") for c in gspmd), gspmd


@pytest.mark.slow
def test_embedding_lookup_is_local_and_summed(partitioned):
    """The vocabulary-sharded embedding (V/8 rows per device) is never gathered: the lookup
    is a masked local gather summed over devices (an all-reduce of B×T×D activations)."""
    hlo = partitioned["mesh", "update_actor"]
    d, v = CONFIG.hidden_size, VOCAB
    for shape in (f"[{v},{d}]", f"[{v // 2},{d}]", f"[{v // 4},{d}]"):
        assert not re.search(rf"{re.escape(shape)}[^ ]* all-gather\(", hlo), shape


def _sft_gradients(mesh, head):
    """(loss, gradients, partitioned HLO) of the step of `python -m hybridjax.sft` (packed
    rows, `packed_sft_gradients`) for a 1-layer model on `mesh` with `head`."""
    from hybridjax.models.lora import split_trainable
    from hybridjax.offline import loop
    from hybridjax.offline.sft import packed_sft_gradients
    from hybridjax.training.packing import PackingConfig

    config = dataclasses.replace(CONFIG, vocab_size=VOCAB, num_hidden_layers=1)
    graphdef, params = nnx.split(init_sharded(CausalLM, config, mesh, ACTOR_TRAIN_RULES, seed=0))
    rng = np.random.default_rng(5)
    lengths = np.array([12, 2, 7, 5, 3, 9, 4, 6])
    attention = (np.arange(12)[None] < lengths[:, None]).astype(np.int32)
    ids = (rng.integers(1, VOCAB, (8, 12)) * attention).astype(np.int32)
    loss_mask = (attention * (np.arange(12)[None] >= lengths[:, None] // 2)).astype(np.float32)
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    batch = loop.place(batch, NamedSharding(mesh, PartitionSpec(("data", "expert", "fsdp"))))
    pieces = math.prod(mesh.shape[a] for a in ("data", "expert", "fsdp"))
    packed = PackingConfig(12, max(8 // pieces, 1), pieces, False)
    trainable, frozen = split_trainable(params)
    fn = lambda t: packed_sft_gradients(graphdef, t, frozen, batch, packed, head)  # noqa: E731
    compiled = jax.jit(fn).lower(trainable).compile()
    (loss, _), grads = compiled(trainable)
    return loss, grads, compiled.as_text()


def logits_sized_collectives(hlo: str) -> list[str]:
    """`head_sized_collectives`, and those whose result includes rows × positions × V or V/2
    logits (GSPMD's partial logits summed over the FSDP-split hidden dimension)."""
    found = head_sized_collectives(hlo)
    for match in COLLECTIVE.finditer(hlo):
        shapes = re.findall(r"\[([0-9,]*)\]", match.group(1))
        if any(s.count(",") >= 2 and s.endswith((f",{VOCAB}", f",{VOCAB // 2}")) for s in shapes):
            found.append(f"{match.group(2)} {match.group(1)[:80]}")
    return found


@pytest.mark.slow  # three compiles of the SFT gradient: about 90 s on two cores
def test_sft_step_runs_the_vocab_parallel_head():
    """`hybridjax.sft` passes its training mesh to the fused head (`training_head`): on
    2 × 2 × 2 its step's loss and gradients equal the one-device step's (float32, 1e-5), and
    its partitioned HLO holds no collective of the head's D × V/2 (or D × V) size nor of
    B × T × V/2 logits; GSPMD's own partitioning of the same step all-reduces such partial
    logits (the check can fail)."""
    from hybridjax.offline.sft import training_head

    mesh = _train_mesh((2, 2, 2))
    one = make_meshes(MeshConfig(train=(1, 1, 1, 1), generate=(1, 1)), jax.devices()[:1]).train
    loss, grads, hlo = _sft_gradients(mesh, training_head(mesh))
    ref_loss, ref_grads, _ = _sft_gradients(one, training_head(one))
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)
    assert logits_sized_collectives(hlo) == []
    gspmd = logits_sized_collectives(_sft_gradients(mesh, LogProbConfig())[2])
    assert any(c.startswith("all-reduce") for c in gspmd), gspmd
