"""The fused LM head (`hybridjax.models.logprobs`) equals full logits, and no pass holds B×T×V.

Values and gradients (float32, 1e-5) against `log_softmax` of full logits: hand-sized heads
(tied and untied, chunks that do not divide T, a temperature), the trainer's stages on ragged
packed and shared-prompt batches, and the same on an 8-device data × fsdp × tensor mesh. The
jaxpr of every pass (old log-prob, the actor update, SFT, DPO) is searched for an array with
B×T×V elements.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.models.logprobs import FUSED, LogProbConfig, token_log_probs
from hybridjax.offline.dpo import sequence_log_probs
from hybridjax.offline.sft import sft_loss
from hybridjax.sharding import ACTOR_TRAIN_RULES, BATCH_AXES, MeshConfig, init_sharded, make_meshes
from hybridjax.training import build
from hybridjax.training import passes as stages
from hybridjax.training.forward import response_log_probs
from tests.rl.test_packing import (
    CONFIG,
    PLAIN,
    TOL,
    R,
    _fields,
    _stage_config,
    _step,
    ragged_batch,
)
from tests.rl.test_packing import models as models  # noqa: F401 (the fixture)

UNFUSED = LogProbConfig(use_fused_kernels=False)


def _assert_trees_close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, **TOL)


FUSED_KEY = "actor_rollout_ref.model.use_fused_kernels"


def _head(tie: bool):
    config = ModelConfig(
        vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie,
    )  # fmt: skip
    return nnx.split(CausalLM(config, nnx.Rngs(0)))


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_fused_head_equals_full_logits(tie, chunk):
    """T = 11 in chunks of 1, 4 (padded to 12) and 64 (one chunk); temperature 0.7; a loss
    weighting every position's log-prob and entropy differently, so each token's gradient
    path is checked."""
    graphdef, params = _head(tie)
    hidden = jax.random.normal(jax.random.key(1), (3, 11, 16))
    targets = jax.random.randint(jax.random.key(2), (3, 11), 0, 48)
    fused = LogProbConfig(chunk_size=chunk)

    def loss(params, hidden, config):
        lp, ent = token_log_probs(nnx.merge(graphdef, params), hidden, targets, 0.7, config, True)
        return jnp.sum(lp * jnp.arange(11)) + jnp.sum(ent * jnp.cos(jnp.arange(11))), (lp, ent)

    grad = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True), static_argnums=2)
    (_, got), got_grads = grad(params, hidden, fused)
    (_, want), want_grads = grad(params, hidden, UNFUSED)
    _assert_trees_close((got, got_grads), (want, want_grads))


def test_hand_computed_log_prob_and_entropy():
    """Logits (0, ln 2, ln 3) at temperature 1 (identity head): p = (1, 2, 3)/6,
    log p(2) = ln 0.5, H = −Σ p ln p."""
    graphdef, params = _head(tie=False)
    model = nnx.merge(graphdef, params)
    model.lm_head.set_value(jnp.zeros((16, 48)).at[:3, :3].set(jnp.eye(3)))
    hidden = jnp.zeros((1, 1, 16)).at[0, 0, :3].set(jnp.log(jnp.asarray([1.0, 2.0, 3.0])))
    hidden = hidden.at[0, 0, :3].add(0.0)
    lp, ent = token_log_probs(model, hidden, jnp.asarray([[2]]), 1.0, LogProbConfig(), True)
    # the other 45 logits are 0: p_v = e^{z_v} / (1 + 2 + 3 + 45)
    z = np.concatenate([np.log([1.0, 2.0, 3.0]), np.zeros(45)])
    p = np.exp(z) / np.exp(z).sum()
    np.testing.assert_allclose(lp[0, 0], np.log(p[2]), rtol=1e-6)
    np.testing.assert_allclose(ent[0, 0], -np.sum(p * np.log(p)), rtol=1e-6)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed_shared_prompt"])
def test_stages_and_updates_equal_unfused(models, packed):  # noqa: F811
    """old/ref log-probs, values, two epochs of actor (entropy bonus, KL loss) and critic
    updates on the ragged batch: fused = full logits, parameters and every metric."""
    base = {} if packed else PLAIN
    fused, unfused = (_step(models, _stage_config(**base, **{FUSED_KEY: f})) for f in (True, False))
    assert _stage_config(**base).head.use_fused_kernels
    for name in ("old_log_probs", "ref_log_prob"):
        np.testing.assert_allclose(getattr(fused[0], name), getattr(unfused[0], name), **TOL)
    for a, b in zip(jax.tree.leaves(fused[1:3]), jax.tree.leaves(unfused[1:3]), strict=True):
        np.testing.assert_allclose(a, b, **TOL)
    for key, value in unfused[3].items():
        np.testing.assert_allclose(fused[3][key], value, **TOL, err_msg=key)


@pytest.mark.parametrize("vocab_parallel", [False, True])
def test_sharded_fused_gradients_equal_single_device_unfused(vocab_parallel):
    """data × fsdp × tensor = 2 × 2 × 2: fused log-probs, entropy and their gradient equal
    the full-logit ones on one device, partitioned by GSPMD or vocab-parallel on the mesh."""
    meshes = make_meshes(MeshConfig(train=(2, 1, 2, 2), generate=(-1, 2)))
    graphdef, params = nnx.split(
        init_sharded(CausalLM, CONFIG, meshes.train, ACTOR_TRAIN_RULES, seed=0)
    )
    batch, _ = ragged_batch()
    rows = NamedSharding(meshes.train, PartitionSpec(BATCH_AXES))
    mask = batch.response_mask

    def loss(params, fields, head):
        lp, ent = response_log_probs(graphdef, params, fields, 0.8, True, head)
        return jnp.sum((lp + 0.3 * ent) * mask) / jnp.sum(mask), (lp * mask, ent * mask)

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=2)
    head = LogProbConfig(chunk_size=2, mesh=meshes.train if vocab_parallel else None)
    (_, got), got_grads = grad(params, jax.device_put(_fields(batch), rows), head)
    local = jax.device_put(params, jax.devices()[0])
    one = jax.device_put(_fields(batch), jax.devices()[0])
    (_, want), want_grads = grad(local, one, UNFUSED)
    _assert_trees_close((got, got_grads), (want, want_grads))


# ------------------------------------------------------------- no B×T×V array in any pass


def _avals(jaxpr):
    """Every intermediate's abstract value in a closed jaxpr, nested jaxprs included."""
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _avals(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _avals(sub)


def _largest_vocab_array(fn, *args) -> int:
    """Elements of the largest array in `fn`'s jaxpr whose last axis is the vocabulary, other
    than the LM head's D×V weight and its gradients and moments."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    weight = (CONFIG.hidden_size, VOCAB)
    avals = [a for a in _avals(jaxpr.jaxpr) if a.shape and a.shape[-1] == VOCAB]
    sizes = [a.size for a in avals if a.shape[-2:] != weight]
    return max(sizes, default=0)


VOCAB = 97  # no other axis of the model has this size (CONFIG's MLP width is its vocabulary)


def _passes(head: LogProbConfig):
    """(name, fn, args, B×T of its LM head) of the old-log-prob pass, the actor update (micro-
    batches of 2 rows, padded), the SFT and the DPO losses' gradients."""
    config = dataclasses.replace(CONFIG, vocab_size=VOCAB)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: CausalLM(config, nnx.Rngs(0))))
    batch, _ = ragged_batch()
    b = batch.batch_size
    cfg = _stage_config(**PLAIN, **{FUSED_KEY: head.use_fused_kernels})
    cfg = dataclasses.replace(cfg, head=head)
    adv = batch.response_mask * 0.5
    batch = batch.replace(advantages=adv, old_log_probs=adv, ref_log_prob=adv)
    state = jax.eval_shape(lambda p: build.init_train_state(p, cfg.actor_optim), params)
    seq = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "loss_mask": batch.attention_mask.astype(jnp.float32),
    }
    t = batch.input_ids.shape[1]
    old = lambda p, bt: stages.compute_old_log_prob(graphdef, p, bt, cfg)
    update = lambda s, bt: stages.update_actor(graphdef, s, bt, jax.random.key(0), cfg)
    sft = jax.grad(lambda p: sft_loss(graphdef, p, seq, head)[0])
    dpo = jax.grad(lambda p: sequence_log_probs(graphdef, p, seq, head)[0].sum())
    micro = 2  # rows per micro-batch of the stages
    return [
        ("old_log_prob", old, (params, batch), micro * R),
        ("update_actor", update, (state, batch), micro * R),
        ("sft", sft, (params,), b * (t - 1)),
        ("dpo", dpo, (params,), b * (t - 1)),
    ]


def test_no_pass_materialises_batch_by_length_by_vocab():
    """Fused (chunks of 2 positions): the largest vocabulary-sized array of each pass is
    smaller than its head's B×T×V; with full logits it is at least that (the check can
    fail)."""
    for head in (LogProbConfig(chunk_size=2), UNFUSED):
        for name, fn, args, tokens in _passes(head):
            largest = _largest_vocab_array(fn, *args)
            full = tokens * VOCAB
            if head.use_fused_kernels:
                assert largest < full, f"{name}: an array of {largest} ≥ B×T×V = {full}"
            else:
                assert largest >= full, f"{name} (unfused): {largest} < {full}"


# ------------------------------------------------- XLA's memory analysis at a mid-size shape

MID = ModelConfig(
    vocab_size=152064, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1,
)  # fmt: skip


def update_temp_bytes(head: LogProbConfig, rows: int = 8, length: int = 1536) -> int:
    """XLA CPU's temporary bytes of value-and-grad of the token-mean −log π over `rows` ×
    `length` positions of a 2-layer model with Qwen2's 152k vocabulary (compiled, never run:
    the parameters are abstract)."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: CausalLM(MID, nnx.Rngs(0))))
    ids = jax.ShapeDtypeStruct((rows, length), jnp.int32)

    def loss(params, ids):
        model = nnx.merge(graphdef, params)
        mask = jnp.ones(ids.shape, jnp.int32)
        hidden, _ = model.model(ids, jnp.broadcast_to(jnp.arange(length), ids.shape), mask)
        lp, ent = token_log_probs(model, hidden, ids, 1.0, head, with_entropy=True)
        return -jnp.mean(lp) - 0.01 * jnp.mean(ent)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_xla_memory_analysis_of_the_update_saves_at_least_the_logits():
    """8 × 1,536 positions × 152,064 float32 logits = 7.5 GB: the fused update's temporaries
    are smaller than the full-logit one's by at least that."""
    logits = 8 * 1536 * MID.vocab_size * 4
    fused, full = update_temp_bytes(LogProbConfig()), update_temp_bytes(UNFUSED)
    assert full - fused >= logits, (full, fused, logits)


def _primitives(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    names |= _primitives(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    names |= _primitives(sub)
    return names


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunking", [False, True])
def test_entropy_keys_choose_remat_and_chunks_of_the_full_logit_path(checkpointing, chunking):
    """Without the fused head, `entropy_checkpointing` wraps the entropy in a remat and
    `entropy_from_logits_with_chunking` walks chunks (a scan); the values do not change."""
    graphdef, params = _head(tie=False)
    hidden = jax.random.normal(jax.random.key(1), (2, 9, 16))
    targets = jnp.zeros((2, 9), jnp.int32)
    head = LogProbConfig(False, checkpointing, chunking, chunk_size=4)

    def entropy_sum(params):
        model = nnx.merge(graphdef, params)
        return token_log_probs(model, hidden, targets, 1.0, head, True)[1].sum()

    jaxpr = jax.make_jaxpr(entropy_sum)(params).jaxpr
    top = {eqn.primitive.name for eqn in jaxpr.eqns}  # the chunks remat inside their scan
    assert bool({"checkpoint", "remat2"} & top) == checkpointing, top
    assert ("scan" in _primitives(jaxpr)) == chunking
    fused = token_log_probs(nnx.merge(graphdef, params), hidden, targets, 1.0, FUSED, True)[1]
    np.testing.assert_allclose(
        token_log_probs(nnx.merge(graphdef, params), hidden, targets, 1.0, head, True)[1],
        fused,
        **TOL,
    )


@pytest.mark.parametrize("tied", [True, False])
def test_top_k_and_log_probs_at_equal_the_full_log_softmax(tied):
    """`top_k_log_probs` (chunks of 3 over 5 positions, ids below a vocabulary limit) and
    `log_probs_at` (and its gradient) against full logits and `log_softmax`."""
    from hybridjax.models.logprobs import log_probs_at, top_k_log_probs

    config = ModelConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied,
    )  # fmt: skip
    model = CausalLM(config, nnx.Rngs(1))
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 40, (2, 5)), jnp.int32)
    full = np.asarray(jax.nn.log_softmax(model.logits(hidden) / 0.7, axis=-1))
    top, ids = top_k_log_probs(model, hidden, 6, 0.7, vocab_limit=30, chunk_size=3)
    want_ids = np.argsort(-full[..., :30], axis=-1)[..., :6]
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(top, np.take_along_axis(full, want_ids, -1), atol=1e-5)
    with pytest.raises(ValueError, match=r"k must be in \[1, 30\]"):
        top_k_log_probs(model, hidden, 31, vocab_limit=30)

    def at(params):
        m = nnx.merge(nnx.graphdef(model), params)
        log_p, _ = token_log_probs(m, hidden, targets, 0.7)
        return log_probs_at(m, hidden, ids, targets, log_p, 0.7)

    def reference(params):
        m = nnx.merge(nnx.graphdef(model), params)
        log_softmax = jax.nn.log_softmax(m.logits(hidden) / 0.7, axis=-1)
        return jnp.take_along_axis(log_softmax, ids, -1)

    params = nnx.state(model)
    np.testing.assert_allclose(at(params), reference(params), atol=1e-5)
    weights = jnp.asarray(rng.normal(size=(2, 5, 6)), jnp.float32)
    got = jax.grad(lambda p: jnp.sum(weights * at(p)))(params)
    want = jax.grad(lambda p: jnp.sum(weights * reference(p)))(params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
