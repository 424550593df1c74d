"""The update loop: micro-batching does not change the update, non-finite updates are skipped,
the LR schedule, and the batch's missing-field error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax.algorithms.loss_agg import agg_loss
from hybridjax.rl.nan_guard import NanGuard, NonFiniteLossError
from hybridjax.training.batch import make_batch
from hybridjax.training.optim import OptimConfig, learning_rate, make_optimizer, set_learning_rate
from hybridjax.training.update import TrainState, UpdateConfig, ppo_update

OPTIM = OptimConfig(lr=0.1, warmup_steps=0, total_steps=10, weight_decay=0.0)


def _fields(seed=0, rows=8, width=5):
    rng = np.random.default_rng(seed)
    mask = (np.arange(width)[None] < rng.integers(0, width + 1, (rows, 1))).astype(np.float32)
    return {"x": jnp.asarray(rng.normal(size=(rows, width, 3)), jnp.float32), "response_mask": mask}


def _loss(mode):
    def loss(params, micro, counts):
        per_token = jnp.square(micro["x"] @ params["w"] - 1.0) + params["b"]
        value = agg_loss(per_token, micro["response_mask"], mode, counts)
        return value, ({"actor/pg_loss": value}, {"x0": micro["x"][:, 0, 0]})

    return loss


def _state():
    params = {"w": jnp.array([0.5, -0.2, 0.1]), "b": jnp.float32(0.3)}
    opt = set_learning_rate(make_optimizer(OPTIM).init(params), 0.1)
    return TrainState(params, opt, jnp.int32(0))


@pytest.mark.parametrize(
    "mode, shuffle",
    [("token-mean", False), ("seq-mean-token-mean", False), ("seq-mean-token-sum", True)],
)
def test_micro_batches_give_the_mini_batch_update(mode, shuffle):
    fields, tx = _fields(), make_optimizer(OPTIM)
    run = lambda micro, shuffle=shuffle: ppo_update(
        _state(), fields, _loss(mode), tx, UpdateConfig(2, 4, micro, shuffle), jax.random.key(0)
    )
    (whole, m_whole, rows), (split, m_split, _) = run(4), run(1)
    if shuffle:  # the permutation changes which rows share a mini-batch
        assert not np.allclose(whole.params["w"], run(4, False)[0].params["w"])
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(split.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m_whole["actor/pg_loss"], m_split["actor/pg_loss"], rtol=1e-6)
    assert int(whole.step) == 1 and int(m_whole["nan_steps"]) == 0
    # per-row outputs come back in the batch's order, whatever the shuffle and the splits
    np.testing.assert_array_equal(rows["x0"], fields["x"][:, 0, 0])


def test_rows_are_computed_before_their_mini_batch_step():
    """Row outputs of the first epoch: the first mini-batch's rows see the initial parameters,
    the second mini-batch's rows the parameters after one optimizer step."""

    def loss(params, micro, counts):
        value = agg_loss(jnp.square(micro["x"] @ params["w"] - 1.0), micro["response_mask"],
                         "token-mean", counts)  # fmt: skip
        return value, ({}, {"w0": jnp.broadcast_to(params["w"][0], micro["x"].shape[:1])})

    state, tx = _state(), make_optimizer(OPTIM)
    new, _, rows = ppo_update(state, _fields(), loss, tx, UpdateConfig(2, 4, 2), jax.random.key(0))
    # rows r % 2 == 0 form mini-batch 0 (see `_split`), the others mini-batch 1
    np.testing.assert_array_equal(rows["w0"][0::2], np.full(4, state.params["w"][0]))
    assert np.all(rows["w0"][1::2] != state.params["w"][0])
    np.testing.assert_array_equal(rows["w0"][1::2], np.full(4, rows["w0"][1]))


def test_non_finite_updates_are_skipped_and_counted():
    fields = _fields()
    fields["x"] = fields["x"].at[0, 0, 0].set(jnp.nan)  # poisons the first of two mini-batches
    fields["response_mask"][0, 0] = 1.0
    state = _state()
    new, metrics, _ = ppo_update(
        state, fields, _loss("token-mean"), make_optimizer(OPTIM), UpdateConfig(1, 4, 2),
        jax.random.key(0),
    )  # fmt: skip
    assert int(metrics["nan_steps"]) == 1
    assert np.all(np.isfinite(new.params["w"]))
    assert not np.array_equal(new.params["w"], state.params["w"])  # the clean one applied


def test_consecutive_non_finite_steps_stop_the_run():
    guard = NanGuard(max_consecutive=2)
    guard.count(1, 1)
    guard.count(0, 2)  # a clean step resets the streak
    guard.count(3, 3)
    with pytest.raises(NonFiniteLossError, match="max_consecutive_nan_steps=2"):
        guard.count(1, 4)
    assert guard.total == 5 and guard.consecutive == 2


def test_learning_rate_schedule():
    warm = OptimConfig(lr=1.0, warmup_steps=4, total_steps=10)
    assert [float(learning_rate(warm, s)) for s in (0, 2, 4, 9)] == [0.0, 0.5, 1.0, 1.0]
    cosine = OptimConfig(lr=1.0, warmup_steps=4, total_steps=10, warmup_style="cosine",
                         min_lr_ratio=0.1)  # fmt: skip
    # step 7: progress 3/6, 0.1 + 0.9 · ½(1 + cos(π/2)) = 0.55
    assert float(learning_rate(cosine, 7)) == pytest.approx(0.55)
    assert float(learning_rate(cosine, 10)) == pytest.approx(0.1)


def test_missing_batch_field_names_its_stage():
    batch = make_batch(
        jnp.ones((2, 3), jnp.int32), jnp.ones((2, 3)), jnp.ones((2, 2), jnp.int32), jnp.ones((2, 2))
    )
    assert batch.input_ids.shape == (2, 5)
    np.testing.assert_array_equal(batch.position_ids[0], [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="RLBatch.advantages is not set: the 'adv' stage"):
        batch.require("response_mask", "advantages")
