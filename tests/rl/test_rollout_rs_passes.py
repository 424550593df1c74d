"""`algorithm.rollout_rs` wired into the stages: the mismatch masks change the policy loss as
their definitions say, on the tiny model with hand-set rollout log-probs (on-policy update,
ratio 1, so the loss is −Σ w·A over the kept tokens / the token count)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax.training import passes
from tests.rl.test_passes import MASK_BxR, _batch, _stage_config
from tests.rl.test_passes import actor as actor  # noqa: F401 (the fixture)

# rollout = π_old − shift per row: token ratios e, 1, 1/e, 1/e; advantages 1, −0.5, 2, −1
SHIFT = np.array([[1.0], [0.0], [-1.0], [-1.0]], np.float32)
ADVANTAGES = jnp.asarray(np.array([[1.0], [-0.5], [2.0], [-1.0]]) * MASK_BxR)
E = math.e


def _update(actor, **changes):  # noqa: F811
    graphdef, state = actor
    cfg = _stage_config(**changes)
    batch, _ = passes.compute_old_log_prob(graphdef, state.params, _batch(), _stage_config())
    batch = batch.replace(rollout_log_probs=(batch.old_log_probs - SHIFT) * MASK_BxR)
    batch, metrics = passes.compute_old_log_prob(graphdef, state.params, batch, cfg)
    batch = batch.replace(advantages=ADVANTAGES)
    _, update_metrics, nan = passes.update_actor(graphdef, state, batch, jax.random.key(0), cfg)
    assert int(nan) == 0
    return batch, metrics | update_metrics


@pytest.mark.parametrize(
    "name, threshold, loss, kept_rows",
    [
        # α 0.5, β 5: rows 2 and 3 (ratio 1/e) leave, row 0 weighs e: −(4e − 1.5) / 7
        ("icepop", 0.0, -(4 * E - 1.5) / 7, [1, 1, 0, 0]),
        # ρ_seq = e⁴, 1, e⁻², e⁻¹: row 0 above the cap 3 leaves, the others weigh ρ_seq
        ("sequence_mask", 0.0, -(-1.5 + 2 * 2 * E**-2 - E**-1) / 6, [0, 1, 1, 1]),
        # KL(rollout ‖ θ) per row −1, 0, 1, 1 against δ 0.5: row 3 (A < 0) leaves in the
        # loss, the denominators stay the batch's 10 tokens
        ("off_policy_sequence_mask", 0.5, -(4 - 1.5 + 4) / 10, [1, 1, 1, 1]),
    ],
)
def test_rollout_rs_entries_change_the_loss_by_hand(actor, name, threshold, loss, kept_rows):  # noqa: F811
    batch, m = _update(
        actor, **{"algorithm.rollout_rs": name, "algorithm.rollout_rs_threshold": threshold}
    )
    np.testing.assert_array_equal(batch.response_mask, MASK_BxR * np.array(kept_rows)[:, None])
    assert float(m["actor/pg_loss"]) == pytest.approx(loss, rel=1e-5)
    if name == "off_policy_sequence_mask":  # shares of the mini-batch, summed by the update
        assert float(m["rollout_corr/rollout_rs_masked_fraction"]) == pytest.approx(0.1)
        assert float(m["rollout_corr/rollout_rs_seq_masked_fraction"]) == pytest.approx(0.25)
    else:
        lost = 1 - float(jnp.sum(batch.response_mask)) / MASK_BxR.sum()
        assert float(m["rollout_corr/rollout_rs_masked_fraction"]) == pytest.approx(lost)
    # the mismatch itself, every step: ratios e (4 tokens), 1 (3), 1/e (3)
    assert float(m["rollout_corr/token_ratio_outside_frac"]) == pytest.approx(0.7)
    assert float(m["rollout_corr/max_abs_log_prob_diff"]) == pytest.approx(1.0, rel=1e-5)
