"""Rollout routing replay (R3): the engine records the experts every prompt and generated token
used (`rollout.enable_rollout_routing_replay`), through shared prompt pages, chunked prefill,
decode and preemption; a training forward that replays them routes exactly as the engine did
and gives the engine's log-probs; when the training router differs from the rollout's, replay
shrinks `training/rollout_probs_diff_max`."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rollout_testing import TINY, make_model, make_prompts
from test_multi_turn import CONFIG as TURNS
from test_multi_turn import PROMPTS, SAMPLING, Scripted

from hybridjax.models.moe import moe_layers, with_router_stats
from hybridjax.rl.generation import routed_experts_array
from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate
from hybridjax.rollout.agent_loop import generate_multi_turn
from hybridjax.sharding import MeshConfig, make_meshes
from hybridjax.training import build, passes
from hybridjax.training.batch import make_batch
from hybridjax.training.forward import model_log_probs
from tests.rl.tiny_run import load_config_file

MOE = dataclasses.replace(
    TINY,
    family="qwen3_moe",
    attention_bias=False,
    num_hidden_layers=3,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    norm_topk_prob=True,
    mlp_only_layers=(1,),
)
LENGTHS = (5, 9, 1, 12)  # 9 and 12 are prefilled in chunks of the 5-token budget
PARAMS = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
CONFIG = RolloutConfig(
    page_size=4,
    max_num_seqs=4,
    prompt_length=16,
    response_length=8,
    decode_steps_per_call=3,
    max_num_batched_tokens=5,
    enable_rollout_routing_replay=True,
)


@pytest.fixture(scope="module")
def rollout():
    """(model, prompts, RolloutOutput, batch with `routed_experts` and rollout log-probs) of 4
    prompts × 2 samples on the tiny MoE (layers 0 and 2 routed)."""
    model = make_model(MOE)
    engine = Engine(model, CONFIG)
    prompts = make_prompts(LENGTHS)
    out = generate(engine, prompts, PARAMS)
    p = max(LENGTHS)
    ids = np.zeros((len(prompts), p), np.int32)
    mask = np.zeros((len(prompts), p), np.int32)
    for i, prompt in enumerate(prompts):  # left-padded, as the data loader writes them
        ids[i, p - len(prompt) :], mask[i, p - len(prompt) :] = prompt, 1
    ids, mask = np.repeat(ids, 2, axis=0), np.repeat(mask, 2, axis=0)
    batch = make_batch(
        jnp.asarray(ids),
        jnp.asarray(mask),
        jnp.asarray(out.responses),
        jnp.asarray(out.response_mask, jnp.float32),
        jnp.asarray(out.rollout_log_probs),
    )
    routed = routed_experts_array(out.routed_experts, mask, out.responses.shape[1])
    return model, prompts, out, batch.replace(routed_experts=jnp.asarray(routed))


def _fields(batch):
    names = ("input_ids", "attention_mask", "position_ids", "responses", "routed_experts")
    return {k: getattr(batch, k) for k in names}


def test_the_engine_records_the_routing_of_every_fed_token(rollout):
    """Each row's record covers its prompt and every sampled token but the last, one entry
    per MoE layer × top-k, equal to the router's own choice in a full forward of the
    sequence (no replay): prompt tokens from whole and chunked prefill (shared by the two
    samples), the prompt's last token and the sampled ones from decode."""
    model, prompts, out, _ = rollout
    assert len(moe_layers(model)) == 2
    forward = with_router_stats(lambda m, ids, mask: m(ids, mask))
    for row, record in enumerate(out.routed_experts):
        prompt = prompts[row // 2]
        seq = list(prompt) + out.responses[row].tolist()
        assert record.shape == (len(seq) - 1, 2, 2) and record.dtype == np.int32
        ids, mask = np.zeros((1, 24), np.int32), np.arange(24)[None] < len(seq)
        ids[0, : len(seq)] = seq  # one compile for every row
        _, stats = forward(model, jnp.asarray(ids), jnp.asarray(mask))
        fresh = np.asarray(stats.expert_ids)[:, 0, : len(seq) - 1]  # L×T×k, recorded positions
        np.testing.assert_array_equal(record, np.moveaxis(fresh, 0, 1))
    # the two samples of a prompt share its prefilled pages, so its prompt's record too
    np.testing.assert_array_equal(
        out.routed_experts[2][: len(prompts[1]) - 1], out.routed_experts[3][: len(prompts[1]) - 1]
    )


def test_replaying_the_recorded_routing_gives_the_engine_log_probs(rollout):
    """The trainer's forward with the batch's `routed_experts` as replay uses exactly the
    recorded experts (its own recorded ids equal them wherever one was recorded; -1, on
    padding and each row's last token, leaves the router's choice) and its log-probs equal
    the engine's within 1e-5."""
    model, _, out, batch = rollout
    fields = _fields(batch)
    (lp, _), stats = with_router_stats(model_log_probs)(model, fields, PARAMS.temperature)
    replay = np.asarray(batch.routed_experts)  # B×T×L×k
    used = np.moveaxis(np.asarray(stats.expert_ids), 0, 2)
    recorded = replay >= 0
    assert recorded.sum() == sum(r.size for r in out.routed_experts)
    np.testing.assert_array_equal(used[recorded], replay[recorded])
    mask = out.response_mask.astype(bool)
    np.testing.assert_allclose(np.asarray(lp)[mask], out.rollout_log_probs[mask], atol=1e-5)


def _perturbed_router(model, scale: float, seed: int = 0):
    """A copy of `model` whose MoE routers' weights get N(0, scale²) noise (the training
    model's router drifting from the rollout's)."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)

    def noisy(path, x):
        if path[-1] == "gate" and x.ndim == 2:
            return x + jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype)
        return x

    flat = [(p, v.replace(noisy(p, v.get_value()))) for p, v in nnx.to_flat_state(state)]
    return graphdef, nnx.from_flat_state(flat)


def _probs_diff_max(graphdef, params, batch, mode: str) -> float:
    c = load_config_file("tiny")
    changes = {
        "data.train_batch_size": 4,
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.rollout.temperature": PARAMS.temperature,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.model.use_remove_padding": False,
        "actor_rollout_ref.actor.router_replay.mode": mode,
    }
    c.update_from_flattened_dict(changes)
    cfg = build.stage_config(c, total_steps=1, data_parallel=1)
    assert cfg.router_replay == mode and cfg.temperature == PARAMS.temperature
    batch = batch if mode == "R3" else batch.replace(routed_experts=None)
    _, metrics = passes.compute_old_log_prob(graphdef, params, batch, cfg)
    return float(metrics["training/rollout_probs_diff_max"])


def test_replay_shrinks_the_rollout_probs_gap_when_the_router_drifts(rollout):
    """Same weights: both modes match the engine (gap < 1e-5). Router weights perturbed
    after the rollout (N(0, 0.1²) on weights of scale 0.2): routing afresh flips experts and
    the old_log_prob pass's `training/rollout_probs_diff_max` grows; replaying the rollout's
    experts (R3) leaves only the change of the routing weights, a gap at least 2× smaller
    (measured 0.090 disabled vs 0.032 R3)."""
    model, _, _, batch = rollout
    graphdef, params = nnx.split(model)
    for mode in ("disabled", "R3"):
        assert _probs_diff_max(graphdef, params, batch, mode) < 1e-5
    graphdef, drifted = _perturbed_router(model, 0.1)
    fresh = _probs_diff_max(graphdef, drifted, batch, "disabled")
    replayed = _probs_diff_max(graphdef, drifted, batch, "R3")
    print(f"rollout_probs_diff_max: disabled {fresh:.4f}, R3 {replayed:.4f}")
    assert replayed * 2 < fresh


@pytest.mark.slow  # a second engine's compiles: ~25 s
def test_a_preempted_sequence_keeps_a_complete_record(rollout):
    """A pool of 8 pages preempts running sequences; each is recomputed from its tokens on
    readmission and its record is that recompute's plus the decode steps after it: the same
    responses and the same records as the run that never preempts."""
    model, prompts, out, _ = rollout
    small = Engine(model, dataclasses.replace(CONFIG, num_pages=8))
    got = generate(small, prompts, PARAMS)
    assert small.num_preemptions > 0
    np.testing.assert_array_equal(got.responses, out.responses)
    for mine, want in zip(got.routed_experts, out.routed_experts, strict=True):
        np.testing.assert_array_equal(mine, want)


@pytest.mark.slow  # its own engine's compiles
def test_multi_turn_records_cover_tool_tokens():
    """Multi-turn (`generate_multi_turn`, tools appended by `Engine.extend`): each row's record
    covers its prompt and every fed model and tool token, equal to the router's choice in a
    full forward of the trajectory."""
    model = make_model(MOE)
    engine = Engine(model, dataclasses.replace(TURNS, enable_rollout_routing_replay=True))
    out = generate_multi_turn(engine, PROMPTS, SAMPLING, Scripted(), max_assistant_turns=3)
    forward = with_router_stats(lambda m, ids, mask: m(ids, mask))
    with_tools = 0
    for row, record in enumerate(out.routed_experts):
        turns, prompt = out.turns[row], PROMPTS[row // 2]
        seq = list(prompt) + [t for _, ids in turns for t in ids]
        assert 0 < len(record) <= len(seq) - 1
        with_tools += len(record) > len(prompt) + len(turns[0][1])
        ids, mask = np.zeros((1, 64), np.int32), np.arange(64)[None] < len(seq)
        ids[0, : len(seq)] = seq
        _, stats = forward(model, jnp.asarray(ids), jnp.asarray(mask))
        fresh = np.moveaxis(np.asarray(stats.expert_ids)[:, 0, : len(record)], 0, 1)
        np.testing.assert_array_equal(record, fresh)
    assert with_tools >= 4  # most trajectories fed a tool response and went on


@pytest.mark.slow  # its own engine's compiles
def test_replicas_record_the_same_routing(rollout):
    """On a generation mesh of 4 replicas × tensor 2 (each replica's rows a block of every
    call's output) the records are the single engine's."""
    model, prompts, out, _ = rollout
    mesh = make_meshes(MeshConfig(generate=(4, 2))).generate
    engine = Engine(model, dataclasses.replace(CONFIG, max_num_seqs=2), mesh=mesh)
    got = generate(engine, prompts, PARAMS)
    assert engine.replicas == 4
    np.testing.assert_array_equal(got.responses, out.responses)
    for mine, want in zip(got.routed_experts, out.routed_experts, strict=True):
        np.testing.assert_array_equal(mine, want)
