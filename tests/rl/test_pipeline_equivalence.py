"""The default pipelines reproduce the trainer's step as it was before the pipeline, bit for bit:
two steps each of PPO + critic, GRPO with a KL loss (and offloading), and ReMax; parameters and
every metric but wall times are equal, and the same timers are reported.

`_frozen_train_step` is the step as `RLTrainer.train_step` ran it before (`trainer.step.prepare`
and `update`, kept here only as the reference): a fixed sequence of calls to the same jitted
stage functions, so any difference in order, inputs, RNG, KL-coefficient threading, donation or
metrics shows up."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax.metrics import compute_perf_metrics
from hybridjax.rl import step
from hybridjax.rl.generation import generate_batch, step_seed
from hybridjax.rl.pipeline import timed
from hybridjax.rl.trainer import RLTrainer
from hybridjax.rollout import SamplingParams
from hybridjax.sharding import load_to_device, offload_to_host
from hybridjax.training.offload import any_offload, move_idle_states
from hybridjax.training.residency import sleep_engine
from tests.rl.tiny_run import gsm8k_subset, tiny_config

pytestmark = pytest.mark.slow

LENGTH_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return (len(solution_str) % 7) / 7.0\n"
)


def _frozen_train_step(t: RLTrainer, n: int) -> dict:
    """The pre-pipeline `RLTrainer.train_step` (with `_generate`, `step.prepare`, `step.update`)."""
    timing, sc, cfg = {}, t.stage_cfg, t.cfg
    with timed(timing, "step"):
        epoch = t.train_loader.epoch
        preemptions = t.engine.num_preemptions
        prompts = next(t.train_loader)
        offload = any_offload(t.offload)
        if offload:
            with timed(timing, "offload"):
                t.models = move_idle_states(t.models, t.offload, offload_to_host)
        with timed(timing, "gen"):
            rollout = cfg.actor_rollout_ref.rollout
            seed = step_seed(cfg.trainer.seed, n, 0)
            sampling = SamplingParams.from_config(rollout, validate=False, seed=seed)
            pad = t.tokenizer.pad_token_id
            batch, host = generate_batch(t.engine, prompts, sampling, pad, t.batch_sharding)
            greedy = None
            if cfg.algorithm.adv_estimator == "remax":
                argmax = dataclasses.replace(sampling, n=1, temperature=0.0, top_k=-1, top_p=1.0)
                greedy = generate_batch(t.engine, prompts, argmax, pad, t.batch_sharding)
        with timed(timing, "sleep"):  # rollout.free_cache_engine (the default)
            released = sleep_engine(t.engine, t.actor_state.params)
        if offload:
            with timed(timing, "onload"):
                t.models = move_idle_states(t.models, t.offload, load_to_device)
        models, device = t.models, {}
        with timed(timing, "reward"):
            scores = t.reward.submit(batch, host)
            greedy_scores = t.reward.submit(*greedy) if greedy else None
        if sc.recompute_old_log_prob:
            with timed(timing, "old_log_prob"):
                g, p = models.actor_graphdef, models.actor_state.params
                batch, m = step._old_log_prob(g, p, batch, sc)
                device |= jax.block_until_ready(m)
        if models.reference() is not None:
            with timed(timing, "ref"):
                batch = step._ref_log_prob(models.actor_graphdef, models.reference(), batch, sc)
                jax.block_until_ready(batch.ref_log_prob)
        if models.critic_state is not None:
            with timed(timing, "values"):
                g, p = models.critic_graphdef, models.critic_state.params
                batch = step._values(g, p, batch, sc)
                jax.block_until_ready(batch.values)
        with timed(timing, "reward"):
            token_scores, result = t.reward.collect(scores)
            batch = batch.replace(token_level_scores=token_scores)
            if greedy_scores is not None:
                baselines = t.reward.baselines(greedy_scores, sc.group_size)
                batch = batch.replace(reward_baselines=baselines)
        with timed(timing, "adv"):
            batch, t.kl_coef, m = step._advantage(batch, t.kl_coef, sc)
            device |= jax.block_until_ready(m)
        rng = jax.random.fold_in(jax.random.key(cfg.trainer.seed), n)
        nan_skipped = jnp.zeros((), jnp.int32)
        if models.critic_state is not None:
            with timed(timing, "update_critic"):
                state, m, nan = step._update_critic(
                    models.critic_graphdef, models.critic_state, batch, rng, sc
                )
                models = dataclasses.replace(models, critic_state=state)
                device |= jax.block_until_ready(m)
                nan_skipped += nan
        if n > cfg.trainer.critic_warmup:
            with timed(timing, "update_actor"):
                state, m, nan = step._update_actor(
                    models.actor_graphdef, models.actor_state, batch, rng, sc
                )
                models = dataclasses.replace(models, actor_state=state)
                device |= jax.block_until_ready(m)
                nan_skipped += nan
        t.models = models
        device |= {"nan_skipped": nan_skipped}
        with timed(timing, "reshard"):
            nbytes = t._update_weights()
            jax.block_until_ready(t.engine.state)
        device |= step.data_metrics(batch, t.use_critic)
        metrics = {k: float(v) for k, v in jax.device_get(device).items()}
    t.nan_guard.count(int(metrics.pop("nan_skipped")), n)
    metrics |= {k: float(v) for k, v in result.metrics.items()}
    metrics |= {f"timing_s/{k}": v for k, v in timing.items()}
    seq_lens = host.prompt_lengths + host.response_lengths
    metrics |= compute_perf_metrics(
        seq_lens, timing, t.n_devices, t.actor_config, sc.actor_update.ppo_epochs, t.peak_flops
    )
    metrics |= {
        "perf/reshard_bytes": float(nbytes),
        "perf/sleep_bytes": float(released),
        "training/global_step": float(n),
        "training/epoch": float(epoch),
        "training/nan_skipped_updates_total": float(t.nan_guard.total),
        "rollout/num_compiles": float(t.engine.num_compiles),
        "rollout/num_preemptions": float(t.engine.num_preemptions - preemptions),
    }
    return metrics


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return gsm8k_subset(tmp_path_factory.mktemp("gsm8k"), train_rows=32, test_rows=8)


CASES = {
    "ppo_critic": {"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive"},
    "grpo_kl_loss": {
        "algorithm.adv_estimator": "grpo",
        "critic.enable": False,
        "actor_rollout_ref.rollout.n": 4,
        "data.train_batch_size": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,  # two mini-batches: old_log_prob runs
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1,
        "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload": True,
    },
    "remax": {
        "algorithm.adv_estimator": "remax",
        "critic.enable": False,
        "actor_rollout_ref.rollout.n": 2,
    },
}


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.mark.parametrize("case", list(CASES))
def test_default_pipeline_equals_the_frozen_step(case, data, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(LENGTH_REWARD)
    changes = {"custom_reward_function.path": str(reward), **CASES[case]}
    trainers = [RLTrainer(tiny_config(data, tmp_path / name, **changes)) for name in "ab"]
    pipelined, frozen = trainers
    initial = _leaves(frozen.actor_state.params)
    for n in (1, 2):
        new, old = pipelined.train_step(n), _frozen_train_step(frozen, n)
        assert {k for k in new if k.startswith("timing_s/")} == {
            k for k in old if k.startswith("timing_s/")
        }
        wall = ("timing_s/", "perf/throughput", "perf/mfu", "perf/time_per_step", "perf/max_mem")
        # compiles are counted per process: both runs share it
        wall += ("rollout/num_compiles", "perf/num_compiles", "perf/compile_time_s")
        # the per-stage placement of offloaded states counts its moves (the frozen step moved
        # them once each way around gen): the optimizer state leaves for gen and reshard
        if "actor_rollout_ref.actor.fsdp_config.optimizer_offload" in CASES[case]:
            opt = sum(x.nbytes for x in jax.tree.leaves(pipelined.actor_state.opt_state))
            assert new.pop("perf/offload_bytes") == new.pop("perf/onload_bytes") == 2 * opt
        new = {k: v for k, v in new.items() if not k.startswith(wall)}
        old = {k: v for k, v in old.items() if not k.startswith(wall)}
        assert new == old, (n, {k: (new.get(k), old.get(k)) for k in new.keys() ^ old.keys()})
    assert float(pipelined.kl_coef) == float(frozen.kl_coef)
    states = lambda t: (t.models.actor_state, t.models.critic_state, t.models.ref_params)
    for a, b in zip(_leaves(states(pipelined)), _leaves(states(frozen)), strict=True):
        np.testing.assert_array_equal(a, b)
    final = _leaves(frozen.actor_state.params)
    moved = max(np.abs(a - b).max() for a, b in zip(final, initial, strict=True))
    assert moved > 0  # the two steps changed the actor
    for t in trainers:
        t.close()
