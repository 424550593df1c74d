"""Packed passes (no padding, shared prompts, token-budget buffers) equal the padded path.

Random ragged batches: groups of 1 to 8 responses to one prompt (unequal sizes), empty
responses, responses at max length, prompts from 1 token to the full width; log-probs,
entropy, values, the actor and critic updates (parameters and metrics), and the same on an
8-device mesh (data × fsdp × tensor = 2 × 2 × 2). float32, tolerance 1e-5.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hybridjax.models import packing
from hybridjax.models.attention import packed_attention_mask
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM, SequenceClassifier
from hybridjax.sharding import ACTOR_TRAIN_RULES, BATCH_AXES, MeshConfig, init_sharded, make_meshes
from hybridjax.training import build, passes
from hybridjax.training.batch import make_batch
from hybridjax.training.forward import packed_map, response_log_probs, response_values
from tests.rl.tiny_run import load_config_file

P, R, N = 6, 5, 4  # prompt columns, response columns, rollout.n of the stage config
GROUP_SIZES = (1, 3, 8, 2, 1, 1)  # 16 rows; groups straddle the rows // N blocks
CONFIG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
)  # fmt: skip
TOL = dict(rtol=1e-5, atol=1e-5)


def ragged_batch(seed=0, group_sizes=GROUP_SIZES):
    """Left-padded prompts shared by each group, right-padded responses; the first group's
    prompt fills all P columns, one response is empty and one at max length."""
    rng = np.random.default_rng(seed)
    b = sum(group_sizes)
    prompts, prompt_mask = np.zeros((b, P), np.int32), np.zeros((b, P), np.int32)
    row, groups = 0, np.zeros(b, np.int32)
    for g, size in enumerate(group_sizes):
        length = P if g == 0 else int(rng.integers(1, P + 1))
        tokens = rng.integers(1, CONFIG.vocab_size, length)
        prompts[row : row + size, P - length :] = tokens
        prompt_mask[row : row + size, P - length :] = 1
        groups[row : row + size] = g
        row += size
    lengths = rng.integers(0, R + 1, b)
    lengths[1], lengths[2] = 0, R
    response_mask = (np.arange(R)[None] < lengths[:, None]).astype(np.float32)
    responses = rng.integers(1, CONFIG.vocab_size, (b, R)) * response_mask.astype(np.int32)
    arrays = map(jnp.asarray, (prompts, prompt_mask, responses, response_mask))
    batch = make_batch(*arrays, uid_B=jnp.asarray(groups))
    return batch, jnp.asarray(groups)


def _fields(batch):
    return {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "responses": batch.responses,
        "response_mask": batch.response_mask,
    }


@pytest.fixture(scope="module")
def models():
    actor = nnx.split(CausalLM(CONFIG, nnx.Rngs(0)))
    critic = nnx.split(SequenceClassifier(dataclasses.replace(CONFIG, num_labels=1), nnx.Rngs(1)))
    return actor, critic


def test_plan_lays_a_group_end_to_end():
    """Two rows of one 2-token prompt (responses of 2 and 1 tokens), then a 1-token prompt
    with a 3-token response: prompt once, positions continuing from the prompt length."""
    ids = jnp.array([[0, 7, 8, 1, 2, 0], [0, 7, 8, 3, 0, 0], [0, 0, 9, 4, 5, 6]])
    mask = (ids > 0).astype(jnp.int32)
    config = packing.PackingConfig(row_length=10, rows=1)
    pl = packing.plan(ids, mask, 3, jnp.array([0, 0, 1]), config)
    buf = packing.buffer(pl, ids, jnp.int32(0))
    np.testing.assert_array_equal(buf["input_ids"][0], [7, 8, 1, 2, 3, 9, 4, 5, 6, 0])
    np.testing.assert_array_equal(buf["positions"][0], [0, 1, 2, 3, 2, 0, 1, 2, 3, 0])
    np.testing.assert_array_equal(buf["prefix_ids"][0, :9], [0, 0, 0, 0, 0, 5, 5, 5, 5])
    # the second response's first token is predicted by the prompt's last token (slot 1)
    np.testing.assert_array_equal(packing.source_index(pl, jnp.int32(0))[0, :6], [0, 0, 1, 2, 1, 4])
    mask_TxT = packed_attention_mask(
        buf["segment_ids"], buf["prefix_ids"], buf["positions"], buf["valid"]
    )[0]
    np.testing.assert_array_equal(mask_TxT[4, :5], [1, 1, 0, 0, 1])  # prompt + itself only
    assert int(pl.num_buffers) == 1
    unshared = packing.plan(ids, mask, 3, jnp.array([0, 1, 2]), config)
    assert int(unshared.num_buffers) == 2  # 5 + 3 + 4 tokens: two rows of 10


@pytest.mark.parametrize("rows, num_buffers", [(3, 7), (3, 6), (3, 2), (1, 4), (4, 1)])
def test_over_buffers_runs_each_buffer_row_once(rows, num_buffers):
    """Full steps of `rows` buffer rows, then the rows left over one by one: every row of
    the plan is computed exactly once and no step holds an empty row."""
    ids = jnp.tile(jnp.array([[5, 6, 7]]), (num_buffers, 1))  # 3 tokens a row, one row each
    config = packing.PackingConfig(row_length=3, rows=rows)
    pl = packing.plan(ids, jnp.ones_like(ids), 1, jnp.arange(num_buffers), config)
    assert int(pl.num_buffers) == num_buffers

    def body(step_plan, k, seen):
        row_ids = k * step_plan.rows + jnp.arange(step_plan.rows)
        counts = jnp.zeros(8, jnp.int32).at[row_ids].add(1)
        steps = seen[1].at[step_plan.rows - 1].add(1)
        return seen[0] + counts, steps

    init = (jnp.zeros(8, jnp.int32), jnp.zeros(rows, jnp.int32))
    counts, steps = jax.jit(lambda pl: packing.over_buffers(pl, body, init))(pl)
    np.testing.assert_array_equal(counts, np.arange(8) < num_buffers)
    full, left = divmod(num_buffers, rows)
    expected = np.zeros(rows, np.int32)
    expected[rows - 1] += full
    expected[0] += left
    np.testing.assert_array_equal(steps, expected)  # steps of `rows` rows, then single rows


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "share, row_length, rows",
    [
        (True, 24, 2),
        (False, P + R, 1),
        pytest.param(True, P + R, 1, marks=SLOW),
        pytest.param(True, P + N * R, 3, marks=SLOW),
        pytest.param(False, 24, 2, marks=SLOW),
    ],
)
def test_packed_forward_passes_equal_padded(models, share, row_length, rows):
    (graphdef, params), (critic_graphdef, critic_params) = models
    batch, groups = ragged_batch()
    fields, mask = _fields(batch), np.asarray(batch.response_mask)
    config = packing.PackingConfig(row_length, rows, pieces=2, share_prompts=share)

    @jax.jit
    def both(params, critic_params):
        fn = lambda f: response_log_probs(graphdef, params, f, 0.7, with_entropy=True)
        values = lambda f: response_values(critic_graphdef, critic_params, f)
        packed = packed_map(fn, fields, groups, config), packed_map(values, fields, groups, config)
        return (fn(fields), values(fields)), packed

    ((log_probs, entropy), values), ((p_log_probs, p_entropy), p_values) = both(
        params, critic_params
    )
    np.testing.assert_allclose(p_log_probs * mask, log_probs * mask, **TOL)
    np.testing.assert_allclose(p_entropy * mask, entropy * mask, **TOL)
    np.testing.assert_allclose(p_values, values, **TOL)
    assert np.all(np.asarray(p_log_probs)[mask == 0] == 0)  # nothing outside the responses


def _stage_config(**changes):
    c = load_config_file("tiny")
    c.data.train_batch_size = 4
    c.actor_rollout_ref.rollout.n = N
    c.actor_rollout_ref.actor.ppo_mini_batch_size = 2  # two mini-batches of 8 rows
    c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 2
    c.actor_rollout_ref.actor.ppo_epochs = 2
    c.actor_rollout_ref.actor.entropy_coeff = 0.01
    c.actor_rollout_ref.actor.use_kl_loss = True
    c.critic.ppo_mini_batch_size = 4
    c.critic.ppo_micro_batch_size_per_gpu = 2
    c.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 2
    c.actor_rollout_ref.rollout.prompt_length = c.data.max_prompt_length = P
    c.actor_rollout_ref.rollout.response_length = c.data.max_response_length = R
    c.update_from_flattened_dict(changes)
    return build.stage_config(c, total_steps=2, data_parallel=1)


PLAIN = {
    "actor_rollout_ref.model.use_remove_padding": False,
    "critic.model.use_remove_padding": False,
}
PACKED = {
    "shared": {},
    "unshared": {"actor_rollout_ref.actor.use_prefix_sharing": False,
                 "actor_rollout_ref.ref.use_prefix_sharing": False,
                 "critic.use_prefix_sharing": False},
    "dynamic": {"actor_rollout_ref.actor.use_dynamic_bsz": True,
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 2 * (P + R),
                "critic.use_dynamic_bsz": True, "critic.ppo_max_token_len_per_gpu": P + R,
                "critic.forward_max_token_len_per_gpu": 40},
}  # fmt: skip


_old_log_prob = jax.jit(passes.compute_old_log_prob, static_argnums=(0, 3))
_ref_log_prob = jax.jit(passes.compute_ref_log_prob, static_argnums=(0, 3))
_values = jax.jit(passes.compute_values, static_argnums=(0, 3))
_update_actor = jax.jit(passes.update_actor, static_argnums=(0, 4))
_update_critic = jax.jit(passes.update_critic, static_argnums=(0, 4))


def _step(models, cfg):
    """old/ref log-probs, values, then both updates on the ragged batch (made-up advantages)."""
    (graphdef, params), (critic_graphdef, critic_params) = models
    actor = build.init_train_state(params, cfg.actor_optim)
    critic = build.init_train_state(critic_params, cfg.critic_optim)
    batch, _ = ragged_batch()
    batch, _ = _old_log_prob(graphdef, params, batch, cfg)
    ref = jax.tree.map(lambda x: x * 1.01, params)
    batch = _ref_log_prob(graphdef, ref, batch, cfg)
    batch = _values(critic_graphdef, critic_params, batch, cfg)
    rng = np.random.default_rng(1)
    adv = jnp.asarray(rng.normal(size=batch.responses.shape), jnp.float32) * batch.response_mask
    batch = batch.replace(advantages=adv, returns=adv + 0.5 * batch.values)
    key = jax.random.key(0)
    actor, actor_metrics, _ = _update_actor(graphdef, actor, batch, key, cfg)
    critic, critic_metrics, _ = _update_critic(critic_graphdef, critic, batch, key, cfg)
    return batch, actor.params, critic.params, actor_metrics | critic_metrics


@pytest.fixture(scope="module")
def plain_step(models):
    return _step(models, _stage_config(**PLAIN))


@pytest.mark.parametrize(
    "variant", ["shared", pytest.param("unshared", marks=SLOW), pytest.param("dynamic", marks=SLOW)]
)
def test_packed_stages_and_updates_equal_padded(models, plain_step, variant):
    cfg = _stage_config(**PACKED[variant])
    assert cfg.actor_update.packing is not None and cfg.values_packing is not None
    plain = plain_step
    packed = _step(models, cfg)
    for name in ("old_log_probs", "ref_log_prob", "values"):
        np.testing.assert_allclose(getattr(packed[0], name), getattr(plain[0], name), **TOL)
    for a, b in zip(jax.tree.leaves(packed[1:3]), jax.tree.leaves(plain[1:3]), strict=True):
        np.testing.assert_allclose(a, b, **TOL)
    assert packed[3].keys() == plain[3].keys()
    for key, value in plain[3].items():
        np.testing.assert_allclose(packed[3][key], value, **TOL, err_msg=key)


def test_sharded_packed_gradients_equal_single_device(models):
    """data × fsdp × tensor = 2 × 2 × 2: packed log-probs and their gradient equal the
    padded single-device ones; each of the 4 data-parallel pieces packs its own rows."""
    meshes = make_meshes(MeshConfig(train=(2, 1, 2, 2), generate=(-1, 2)))
    graphdef, params = nnx.split(
        init_sharded(CausalLM, CONFIG, meshes.train, ACTOR_TRAIN_RULES, seed=0)
    )
    batch, groups = ragged_batch()
    rows = NamedSharding(meshes.train, PartitionSpec(BATCH_AXES))
    fields = jax.device_put(_fields(batch), rows)
    config = packing.PackingConfig(P + N * R, 2, pieces=4)
    mask = batch.response_mask

    def loss(params, fields):  # a buffer's share of the token-mean −log π
        lp = response_log_probs(graphdef, params, fields, 1.0)[0] * mask
        return jnp.sum(lp) / jnp.sum(mask), lp

    @jax.jit
    def packed(params, fields):  # gradients summed over buffers, as `ppo_update`
        pl = packing.plan(fields["input_ids"], fields["attention_mask"], R, groups, config)

        def body(step_plan, k, acc):
            f = dict(fields, pack_plan=step_plan, pack_buffer=k)
            (_, lp), g = jax.value_and_grad(loss, has_aux=True)(params, f)
            return jax.tree.map(jnp.add, acc, (lp, g))

        return packing.over_buffers(pl, body, jax.tree.map(jnp.zeros_like, (mask, params)))

    lp, g = packed(params, fields)
    local = jax.device_put(params, jax.devices()[0])
    (_, lp_plain), g_plain = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        local, jax.device_put(_fields(batch), jax.devices()[0])
    )
    np.testing.assert_allclose(lp, lp_plain, **TOL)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_plain), strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def _last_token_scores(batch) -> jax.Array:
    """A fixed score per row on its last valid response token (what `reward` writes)."""
    mask = np.asarray(batch.response_mask)
    scores = np.zeros(mask.shape, np.float32)
    rows = np.flatnonzero(mask.sum(-1))
    scores[rows, mask.sum(-1)[rows].astype(int) - 1] = np.linspace(0, 1, len(rows))
    return jnp.asarray(scores)


def _two_rl_steps(models, changes):
    """Steps 1 and 2 of the default step's device stages (old_log_prob → ref → values → adv →
    update_critic → update_actor) on ragged batches of 4 groups of 4."""
    from hybridjax.rl import step

    cfg = _stage_config(**changes)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # the update stages donate the states
    (graphdef, params), (critic_graphdef, critic_params) = copy(models)
    actor = build.init_train_state(copy(params), cfg.actor_optim)
    use_critic = changes.get("critic.enable", True)
    critic = build.init_train_state(critic_params, cfg.critic_optim) if use_critic else None
    metrics = []
    for n in (1, 2):
        batch, _ = ragged_batch(seed=n, group_sizes=(4, 4, 4, 4))
        batch = batch.replace(token_level_scores=_last_token_scores(batch))
        batch, device = step._old_log_prob(graphdef, actor.params, batch, cfg)
        batch = step._ref_log_prob(graphdef, params, batch, cfg)  # the initial actor
        if use_critic:
            batch = step._values(critic_graphdef, critic.params, batch, cfg)
        batch, _, m = step._advantage(batch, jnp.float32(0.01), cfg)
        device |= m
        rng = jax.random.key(n)
        if use_critic:
            critic, m, _ = step._update_critic(critic_graphdef, critic, batch, rng, cfg)
            device |= m
        actor, m, _ = step._update_actor(graphdef, actor, batch, rng, cfg)
        metrics.append({k: float(v) for k, v in (device | m).items()})
    return build.Models(graphdef, actor, params, critic_graphdef, critic, None), metrics


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm",
    [{"algorithm.adv_estimator": "grpo", "critic.enable": False}, {}],
    ids=["grpo", "ppo"],
)
def test_two_rl_steps_packed_equal_padded(models, algorithm):
    """Two full PPO (critic, GAE) and GRPO steps: same parameters and metrics (1e-5)."""
    plain_state, plain = _two_rl_steps(models, PLAIN | algorithm)
    packed_state, packed = _two_rl_steps(models, algorithm)
    states = [(plain_state.actor_state, packed_state.actor_state)]
    if plain_state.critic_state is not None:
        states.append((plain_state.critic_state, packed_state.critic_state))
    for a, b in states:
        for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
            np.testing.assert_allclose(y, x, **TOL)
    for m_plain, m_packed in zip(plain, packed, strict=True):
        assert m_plain.keys() == m_packed.keys()
        for key, value in m_plain.items():
            np.testing.assert_allclose(m_packed[key], value, **TOL, err_msg=key)


def test_packed_reward_model_scores_equal_padded(models):
    """The reward model's last-token scores, packed with shared prompts (one buffer row per
    step, so groups also straddle steps), equal the padded forward's."""
    from hybridjax.rewards.reward_model import score_responses

    _, (graphdef, params) = models
    batch, _ = ragged_batch()
    args = (batch.prompts, batch.attention_mask[:, :P], batch.responses, batch.response_mask)
    token_level, scores = score_responses(graphdef, params, *args)
    config = packing.PackingConfig(P + 2 * R, 1, pieces=2)
    p_token_level, p_scores = score_responses(graphdef, params, *args, packing=config)
    np.testing.assert_allclose(p_scores, scores, **TOL)
    np.testing.assert_allclose(p_token_level, token_level, **TOL)
    assert np.std(np.asarray(scores)) > 1e-4


def test_packed_sft_gradient_equals_padded(models):
    """`python -m hybridjax.sft`'s packed step: pairs of 2 to 12 tokens in rows of 12, the
    loss and gradient equal the padded token-mean NLL's."""
    from hybridjax.models.lora import split_trainable
    from hybridjax.offline.sft import packed_sft_gradients, sft_loss

    (graphdef, params), _ = models
    rng = np.random.default_rng(3)
    lengths = np.array([12, 2, 7, 5, 3, 9, 4, 6])
    attention = (np.arange(12)[None] < lengths[:, None]).astype(np.int32)
    ids = rng.integers(1, CONFIG.vocab_size, (8, 12)) * attention
    loss_mask = attention * (np.arange(12)[None] >= lengths[:, None] // 2)
    batch = jax.tree.map(jnp.asarray, {"input_ids": ids, "attention_mask": attention,
                                       "loss_mask": loss_mask.astype(np.float32)})  # fmt: skip

    def padded(params):
        total, count = sft_loss(graphdef, params, batch)
        return total / count

    loss, grads = jax.jit(jax.value_and_grad(padded))(params)
    config = packing.PackingConfig(12, 2, pieces=2, share_prompts=False)
    trainable, frozen = split_trainable(params)
    packed = lambda t: packed_sft_gradients(graphdef, t, frozen, batch, config)
    (p_loss, _), p_grads = jax.jit(packed)(trainable)
    np.testing.assert_allclose(p_loss, loss, **TOL)
    for a, b in zip(jax.tree.leaves(p_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def test_packing_keys_are_read_and_checked():
    from hybridjax.training.packing import packing_configs, packing_problems

    c = load_config_file("tiny")  # P 256, R 32
    c.actor_rollout_ref.rollout.n = 4
    c.actor_rollout_ref.actor.use_dynamic_bsz = True
    c.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = 4096
    c.actor_rollout_ref.ref.use_prefix_sharing = False
    c.critic.model.use_remove_padding = False
    configs = packing_configs(c, data_parallel=2)
    # no model given: a whole group per row, P + n·R = 384 tokens; a quarter budget per step
    assert configs["update_actor"] == packing.PackingConfig(384, 2, 2, True)
    assert configs["ref"].share_prompts is False and configs["ref"].row_length == 288
    assert configs["values"] is None and configs["update_critic"] is None
    assert packing_problems(c) == []
    c.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = 100
    c.critic.use_dynamic_bsz = True
    problems = packing_problems(c)
    assert any("ppo_max_token_len_per_gpu: must hold one sequence" in p for p in problems)
    assert any(
        "critic.use_dynamic_bsz: needs critic.model.use_remove_padding" in p for p in problems
    )


def test_row_length_minimises_token_and_attention_work():
    # cost of a group at full lengths: ceil(n/k) rows of L = P + k·R, each L + pair_cost·L²
    # quick-start shape (P 29, R 16, n 4, 3.4M model: pair_cost 1/1672): k = 1..4 cost
    # 184.8, 126.5, 161.1, 98.2 → the whole group in a row of 93
    assert packing.row_responses(29, 16, 4, 1 / 1672, 1440) == 4
    assert packing.PackingConfig.for_budget(1440, 29, 16, 4, 1 / 1672) == packing.PackingConfig(
        93, 3
    )
    # GSM8K prompts with 256-token responses on the same model (P 185, n 8): k = 1, 2, 3, 4, 8
    # cost 4536, 4047, 4625, 4313, 5465 → rows of a prompt and 2 responses (697 tokens)
    assert packing.row_responses(185, 256, 8, 1 / 1543, 28224) == 2
    # attention free (pair_cost 0): the whole group, unless the budget caps the row; then the
    # fewest tokens among the rows that fit: k = 2 (4 rows, 2,788) beats k = 3 (3 rows, 2,859)
    assert packing.row_responses(185, 256, 8, 0.0, 100_000) == 8
    assert packing.row_responses(185, 256, 8, 0.0, 1000) == 2
    # without sharing a row is one sequence
    assert packing.PackingConfig.for_budget(1440, 29, 16, 4, share_prompts=False).row_length == 45


def test_attention_pair_cost_of_a_model():
    from hybridjax.metrics import matmul_params
    from hybridjax.models.config import ModelConfig
    from hybridjax.training.packing import attention_pair_cost

    shape = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    config = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, **shape)
    # 12·d·H·layers FLOPs per pair vs 6·N per token: 2·64·4·4 / N, N = 4 layers × (attention
    # 196,608 + MLP 528,384 + norms 512) + final norm 256 + LM head 262,144 = 3,164,416
    assert matmul_params(config) == 3_164_416
    assert attention_pair_cost(config) == pytest.approx(2048 / 3_164_416)
