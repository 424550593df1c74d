"""Roles on split pools and rollout ahead of training, end to end on 8 simulated CPU devices
(the tiny config on GSM8K rows): rollout on devices 0-3 and training on 4-7 give the step of the
co-located run; `async` with staleness 0 is `sync`; `one_step_off` trains every batch after the
first on weights one update newer than the ones that sampled it, with rollout IS weights."""

from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from hybridjax.models.decoder import SequenceClassifier
from hybridjax.models.hf_io import save_pretrained
from hybridjax.rl.trainer import RLTrainer
from hybridjax.training import build
from tests.rl.tiny_run import gsm8k_subset, tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return gsm8k_subset(tmp_path_factory.mktemp("gsm8k"), train_rows=32, test_rows=8)


def _config(data, run_dir, split: bool, **changes):
    c = tiny_config(data, run_dir, **{"trainer.test_freq": -1, "trainer.save_freq": -1})
    # data parallelism, replicated parameters (not the default FSDP): the pools' meshes then
    # differ in their data size alone, and every placement sums the same gradient; FSDP over
    # 8, 4 or 2 devices would sum the shards in other orders, which AdamW's first steps
    # amplify past 1e-6 where a gradient is near zero
    c.mesh.train.data, c.mesh.train.fsdp = -1, 1
    c.actor_rollout_ref.rollout.max_num_seqs = 8
    if split:  # the training pool keeps the name global_pool: every other role stays there
        c.resource_pool = dict(rollout_pool=dict(n_devices=4), global_pool=dict(n_devices=4))
        c.placement.rollout = "rollout_pool"
    c.update_from_flattened_dict(changes)
    return c


def _steps(config, steps: int, score_ahead: bool | None = None):
    trainer = RLTrainer(config)
    if score_ahead is not None:
        trainer.rollout_ahead.score_enabled = score_ahead
    trainer.scored_on = []  # the thread that started each batch's scoring
    submit = trainer.reward.submit

    def spy(batch, host, step=0):
        trainer.scored_on.append((step, threading.current_thread().name))
        return submit(batch, host, step)

    trainer.reward.submit = spy
    try:
        metrics = [trainer.train_step(n) for n in range(1, steps + 1)]
        params = [
            np.asarray(x) for x in jax.tree.leaves(jax.device_get(trainer.actor_state.params))
        ]
        return trainer, metrics, params
    finally:
        trainer.close()


def _numbers(metrics: dict) -> dict:
    skip = ("timing_s/", "perf/", "rollout/num_compiles", "async/")
    return {k: v for k, v in metrics.items() if not k.startswith(skip)}


def test_split_pools_give_the_co_located_step(data, tmp_path):
    """With a (random) reward model: all on 8 devices; rollout on 4 + the rest on 4; training
    on 4, reward model on 2, rollout on 2. Same first step within 1e-6."""
    rm = {"reward_model.enable": True, "reward_model.model.path": str(tmp_path / "rm")}
    together_cfg = _config(data, tmp_path / "a", split=False, **rm)
    shape = build.actor_model_config(together_cfg, build.load_tokenizer(together_cfg))
    classifier = SequenceClassifier(dataclasses.replace(shape, num_labels=1), nnx.Rngs(7))
    save_pretrained(classifier, tmp_path / "rm")
    _, (together,), params_together = _steps(together_cfg, 1)
    trainer, (split,), params_split = _steps(_config(data, tmp_path / "b", split=True, **rm), 1)
    # pools take devices in name order: global_pool 0-3, rollout_pool 4-7
    assert {d.id for d in trainer.meshes.train.devices.flat} == {0, 1, 2, 3}
    assert {d.id for d in trainer.meshes.generate.devices.flat} == {4, 5, 6, 7}
    assert split["timing_s/update_weights"] > 0 and split["perf/reshard_bytes"] > 0
    three = _config(data, tmp_path / "c", split=False, **rm)
    three.resource_pool = dict(
        global_pool=dict(n_devices=4), reward_pool=dict(n_devices=2), rollout_pool=dict(n_devices=2)
    )
    three.placement.update(dict(rollout="rollout_pool", reward_model="reward_pool"))
    trainer, (third,), params_third = _steps(three, 1)
    _, rm_params = trainer.models.reward_model
    assert {d.id for x in jax.tree.leaves(rm_params) for d in x.sharding.device_set} == {4, 5}
    # the reward model's int32 inputs (prompt ids and mask, response ids and mask) go to its
    # pool, its float32 B×R token scores come back; each row is written once
    rows = three.data.train_batch_size * three.actor_rollout_ref.rollout.n
    p, r = (
        three.actor_rollout_ref.rollout.prompt_length,
        three.actor_rollout_ref.rollout.response_length,
    )
    assert third["perf/transfer_bytes"] == rows * (2 * p + 2 * r) * 4 + rows * r * 4
    assert "perf/transfer_bytes" not in together
    assert {d.id for d in trainer.meshes.generate.devices.flat} == {6, 7}
    for metrics, params in ((split, params_split), (third, params_third)):
        assert _numbers(metrics).keys() == _numbers(together).keys()
        for key, value in _numbers(together).items():
            np.testing.assert_allclose(metrics[key], value, rtol=1e-6, atol=1e-6, err_msg=key)
        for a, b in zip(params_together, params, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_staleness_zero_is_sync(data, tmp_path):
    _, sync, params_sync = _steps(_config(data, tmp_path / "s", split=True), 2)
    async0 = _config(data, tmp_path / "a", split=True, **{"trainer.rollout_mode": "async"})
    async0.trainer.staleness_threshold = 0
    _, zero, params_zero = _steps(async0, 2)
    for m_sync, m_zero in zip(sync, zero, strict=True):
        assert _numbers(m_sync) == _numbers(m_zero)
        assert m_zero["async/staleness_max"] == 0
    for a, b in zip(params_sync, params_zero, strict=True):
        np.testing.assert_array_equal(a, b)


def test_one_step_off_lags_by_exactly_one(data, tmp_path):
    off = _config(
        data,
        tmp_path / "o",
        split=True,
        **{
            "trainer.rollout_mode": "one_step_off",
            "algorithm.rollout_is": True,
            "algorithm.rollout_is_threshold": 2.0,
        },
    )
    trainer, metrics, params = _steps(off, 3)
    assert trainer.rollout_ahead.score_enabled
    # each batch is scored on the rollout thread as soon as it is generated (batch k+1 while
    # step k trains); the same steps as scoring in the reward stage, bit for bit
    # (batch 4 may be requested too: the run has more steps)
    assert trainer.scored_on[:3] == [(1, "rollout"), (2, "rollout"), (3, "rollout")]
    assert {1, 2, 3} <= {n for _, n, _, _ in trainer.reward.events}
    gen_end = {n: end for _, n, _, end in trainer.rollout_ahead.events}
    assert all(start >= gen_end[n] for _, n, start, _ in trainer.reward.events)
    later, later_metrics, later_params = _steps(off, 3, score_ahead=False)
    assert later.scored_on == [(1, "MainThread"), (2, "MainThread"), (3, "MainThread")]
    for a, b in zip(metrics, later_metrics, strict=True):
        assert _numbers(a) == _numbers(b)
    for a, b in zip(params, later_params, strict=True):
        np.testing.assert_array_equal(a, b)
    assert [m["async/staleness_max"] for m in metrics] == [0, 1, 1]
    assert [m["async/staleness_mean"] for m in metrics] == [0, 1, 1]
    np.testing.assert_array_equal(trainer.policy_versions, 1)  # step 3 sampled by version 1
    assert all("timing_s/old_log_prob" in m for m in metrics)  # π_old recomputed
    for m in metrics:
        assert all(np.isfinite(v) for v in m.values())
        assert m["timing_s/wait_rollout"] >= 0 and m["timing_s/wait_update"] >= 0
    # IS weights applied; from step 2 on the sampling policy lags π_old by one update, so the
    # rollout / π_old log-prob gap grows past step 1's numerical one
    assert all("mismatch/rollout_is_mean" in m for m in metrics)
    diffs = [m["training/rollout_probs_diff_mean"] for m in metrics]
    assert diffs[2] > 10 * diffs[0], diffs


def test_critic_and_ref_on_their_own_pools_give_the_co_located_steps(data, tmp_path):
    """PPO with a critic and a KL reference (in the reward and as a loss): all on 8 devices
    against actor + rollout on 4, critic on 2, reference on 2. The same first two steps within
    1e-6 (metrics, actor and critic parameters); each pass runs on its own pool's devices and
    the batches cross pools (counted)."""
    kl = {
        "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.kl_loss_coef": 0.1,
        "algorithm.use_kl_in_reward": True,
    }
    together = _config(data, tmp_path / "a", split=False, **kl)
    split = _config(data, tmp_path / "b", split=False, **kl)
    split.resource_pool = dict(
        critic_pool=dict(n_devices=2), global_pool=dict(n_devices=4), ref_pool=dict(n_devices=2)
    )
    split.placement.update(dict(critic="critic_pool", ref="ref_pool"))

    def run(config):
        trainer = RLTrainer(config)
        try:
            metrics = [trainer.train_step(n) for n in (1, 2)]
            m = trainer.models
            leaves = lambda tree: [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]
            devices = lambda tree: {d.id for x in jax.tree.leaves(tree) for d in x.devices()}
            where = {
                "critic": devices(m.critic_state.params),
                "ref": devices(m.reference()),
                "actor": devices(m.actor_state.params),
            }
            return metrics, leaves(m.actor_state.params) + leaves(m.critic_state.params), where
        finally:
            trainer.close()

    metrics_a, params_a, _ = run(together)
    metrics_b, params_b, where = run(split)
    assert where == {"critic": {0, 1}, "actor": {2, 3, 4, 5}, "ref": {6, 7}}
    for a, b in zip(metrics_a, metrics_b, strict=True):
        assert b["perf/transfer_bytes"] > 0 and b["timing_s/transfer"] > 0
        assert "perf/transfer_bytes" not in a
        assert _numbers(a).keys() == _numbers(b).keys()
        assert {"critic/vf_loss", "actor/kl_loss", "actor/reward_kl_penalty"} <= a.keys()
        for key, value in _numbers(a).items():
            np.testing.assert_allclose(b[key], value, rtol=1e-6, atol=1e-6, err_msg=key)
    for a, b in zip(params_a, params_b, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_teacher_on_its_own_pool_gives_the_co_located_step(data, tmp_path):
    """On-policy distillation (loss_mode reward, a teacher one layer deeper than the student):
    all on 8 devices against the rest on 4 and the teacher on 4 (`placement.teacher`), its weights
    offloaded to host memory during generation. The same first step within 1e-5; the teacher's
    forward runs on its pool and the batch crosses to it and back (counted)."""
    distill = {
        "actor_rollout_ref.distillation.enabled": True,
        "actor_rollout_ref.distillation.teacher_model.override_config": {"num_hidden_layers": 3},
    }
    together = _config(data, tmp_path / "a", split=False, **distill)
    split = _config(data, tmp_path / "b", split=False, **distill)
    split.resource_pool = dict(global_pool=dict(n_devices=4), teacher_pool=dict(n_devices=4))
    split.placement.teacher = "teacher_pool"
    split.actor_rollout_ref.distillation.teacher_model.fsdp_config.param_offload = True

    def run(config):
        trainer = RLTrainer(config)
        try:
            metrics = trainer.train_step(1)
            _, teacher = trainer.models.teacher
            devices = {d.id for x in jax.tree.leaves(teacher) for d in x.devices()}
            kinds = {x.sharding.memory_kind for x in jax.tree.leaves(teacher)}
            params = [np.asarray(x) for x in jax.tree.leaves(trainer.actor_state.params)]
            return metrics, params, devices, kinds
        finally:
            trainer.close()

    a, params_a, devices_a, _ = run(together)
    b, params_b, devices_b, kinds_b = run(split)
    assert devices_a == set(range(8)) and devices_b == {4, 5, 6, 7}
    assert kinds_b == {"device"}  # back on the devices after the rollout (onload)
    assert "timing_s/offload" in b and "timing_s/offload" not in a
    assert b["perf/transfer_bytes"] > 0 and "perf/transfer_bytes" not in a
    assert a["distill/reverse_kl"] > 1e-3  # the teacher differs from the student
    assert _numbers(a).keys() == _numbers(b).keys()
    for key, value in _numbers(a).items():
        np.testing.assert_allclose(b[key], value, rtol=1e-5, atol=1e-5, err_msg=key)
    for x, y in zip(params_a, params_b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_partial_rollouts_carry_running_groups_over_with_their_versions(data, tmp_path):
    """async + partial_rollout, staleness 2 (requested one step ahead), n = 3 on 8 slots: the
    groups are admitted staggered, so a batch is full while later groups still run; they carry
    over and finish under newer weights. Tokens record their versions, the bound holds per
    token, π_old is recomputed and the rollout IS weights apply per token; a validation between
    steps leaves the carried sequences to continue."""
    changes = {
        "trainer.rollout_mode": "async",
        "trainer.staleness_threshold": 2,
        "trainer.partial_rollout": True,
        "actor_rollout_ref.rollout.n": 3,
        "algorithm.rollout_is": True,
        "algorithm.rollout_is_threshold": 2.0,
    }
    trainer = RLTrainer(_config(data, tmp_path / "p", split=True, **changes))
    try:
        metrics = [trainer.train_step(1)]
        accuracy = trainer.validate()  # sets the carried sequences aside, then resumes them
        metrics += [trainer.train_step(n) for n in (2, 3)]
    finally:
        trainer.close()
    assert any(k.startswith("val-core/") for k in accuracy)
    partial = trainer.partial
    assert partial is not None and partial.num_recomputed > 0  # swapped mid-sequence
    versions = trainer.token_versions  # step 3: B·n × R
    rows = 8 * 3
    assert versions.shape == (rows, 16) and len(trainer.policy_versions) == rows
    lag = (3 - 1) - versions[versions >= 0]
    assert lag.min() >= 0 and lag.max() <= 2  # the bound, per token
    assert max(m["async/partial_fraction"] for m in metrics) > 0
    assert all(m["async/staleness_max"] <= 2 for m in metrics)
    for m in metrics:
        assert "timing_s/old_log_prob" in m and "mismatch/rollout_is_mean" in m
        assert all(np.isfinite(v) for v in m.values())
