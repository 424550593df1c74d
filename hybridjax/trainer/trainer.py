"""The RL trainer: one controller driving the step as a straight line of named stages.

    gen → reward → old_log_prob → ref → values → adv → update_critic → update_actor → reshard

Each stage is timed as `timing_s/<stage>` (ending with a device sync so the time is the
stage's own). Which stages run follows from the config (a critic when `critic.enable`, a
reference when a KL term is configured); which algorithm runs is the registries' business.
Metrics of a step are pulled to the host in one `device_get` at its end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import ConfigDict

from hybridjax.algorithms.advantages import needs_reward_baseline
from hybridjax.checkpointing import Checkpointer, StopRequest, split_checkpoint_path
from hybridjax.data.dataset import DataConfig, train_loader, val_loader
from hybridjax.metrics import (
    Tracking,
    compute_data_metrics,
    compute_perf_metrics,
    measure_peak_flops,
)
from hybridjax.models.config import to_dtype
from hybridjax.rewards import RewardConfig, RewardManager
from hybridjax.rollout import Engine, RolloutConfig, SamplingParams
from hybridjax.sharding import (
    ACTOR_GENERATE_RULES,
    MeshConfig,
    OffloadConfig,
    load_to_device,
    make_meshes,
    offload_to_host,
    state_shardings,
    update_weights,
)
from hybridjax.trainer import build, stages
from hybridjax.trainer.batch import RLBatch
from hybridjax.trainer.generation import HostColumns, generate_batch, step_seed
from hybridjax.trainer.reward import RewardStage
from hybridjax.trainer.validate import validate as validate_config
from hybridjax.trainer.validation import validate

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps whose updates were skipped for NaN/inf loss or gradients."""


# Jitted once per process, shared by every trainer (graph definitions and StageConfig static).
_old_log_prob = jax.jit(stages.compute_old_log_prob, static_argnums=(0, 3))
_ref_log_prob = jax.jit(stages.compute_ref_log_prob, static_argnums=(0, 3))
_values = jax.jit(stages.compute_values, static_argnums=(0, 3))
_advantage = jax.jit(stages.compute_advantage, static_argnums=2)
_update_actor = jax.jit(stages.update_actor, static_argnums=(0, 4), donate_argnums=1)
_update_critic = jax.jit(stages.update_critic, static_argnums=(0, 4), donate_argnums=1)
_data_metrics = jax.jit(compute_data_metrics, static_argnums=1)
_init_train_state = jax.jit(stages.init_train_state, static_argnums=1)


@contextlib.contextmanager
def timed(timing: dict[str, float], name: str):
    """Adds the wall time of the block to `timing[name]` (seconds)."""
    start = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


class RLTrainer:
    """PPO / GRPO / ... trainer over one device set (verl's `RayPPOTrainer`, one process).

    Args:
      cfg: a full trainer ConfigDict (`hybridjax.trainer.config.base_config()` + changes).
    Raises:
      ConfigError: the config has problems (all listed in one message).
    """

    def __init__(self, cfg: ConfigDict):
        self.cfg = cfg
        self.n_devices = jax.device_count()
        self.tokenizer = build.load_tokenizer(cfg)
        self.actor_config = build.actor_model_config(cfg, self.tokenizer)
        validate_config(cfg, self.n_devices, {"actor_rollout_ref.model": self.actor_config})
        self.meshes = make_meshes(MeshConfig.from_config(cfg))
        dp = self.meshes.train.shape["data"] * self.meshes.train.shape["fsdp"]
        self.batch_sharding = NamedSharding(self.meshes.train, PartitionSpec(("data", "fsdp")))

        data = DataConfig.from_config(cfg.data)
        self.train_loader = train_loader(data, self.tokenizer)
        self.val_loader = val_loader(data, self.tokenizer) if data.val_files else None
        t = cfg.trainer
        self.total_steps = (
            t.total_training_steps
            if t.total_training_steps > 0
            else len(self.train_loader) * t.total_epochs
        )
        self.stage_cfg = build.stage_config(cfg, self.total_steps, dp)
        self.use_critic = cfg.critic.enable
        sc = self.stage_cfg
        self.use_ref = sc.actor_loss.use_kl_loss or sc.algorithm.use_kl_in_reward
        a = cfg.actor_rollout_ref
        self.offload = {
            "actor": OffloadConfig.from_config(a.actor.fsdp_config),
            "ref": OffloadConfig.from_config(a.ref.fsdp_config),
            "critic": OffloadConfig.from_config(cfg.critic.model.fsdp_config),
        }
        self.offload_any = any(
            o.param_offload or o.optimizer_offload for o in self.offload.values()
        )
        self._build_models()
        self.reward = RewardStage(
            RewardManager(RewardConfig.from_config(cfg)),
            self.tokenizer,
            self.reward_model,
            cfg.reward_model.micro_batch_size_per_gpu,
            self.batch_sharding,
            dp,
        )
        self.greedy_baseline = needs_reward_baseline(cfg.algorithm.adv_estimator)
        self.checkpointer = Checkpointer(t.default_local_dir, t.max_actor_ckpt_to_keep)
        self.peak_flops = t.peak_flops or measure_peak_flops()
        replicated = NamedSharding(self.meshes.train, PartitionSpec())
        self.kl_coef = jax.device_put(jnp.float32(cfg.algorithm.kl_ctrl.kl_coef), replicated)
        self.global_step = 0
        self.nan_consecutive = 0
        self.nan_total = 0

    # ------------------------------------------------------------------------------ set-up

    def _build_models(self) -> None:
        cfg, seed, mesh = self.cfg, self.cfg.trainer.seed, self.meshes.train
        actor = build.build_actor(cfg, self.actor_config, mesh, seed)
        self.actor_graphdef, params = nnx.split(actor)
        self.ref_params = jax.tree.map(jnp.copy, params) if self.use_ref else None
        self.actor_state = _init_train_state(params, self.stage_cfg.actor_optim)
        self.critic_state = None
        if self.use_critic:
            critic_config = build.critic_model_config(cfg, self.actor_config)
            critic = build.build_critic(cfg, critic_config, mesh, seed + 1)
            self.critic_graphdef, critic_params = nnx.split(critic)
            self.critic_state = _init_train_state(critic_params, self.stage_cfg.critic_optim)
        self.reward_model = None
        if cfg.reward_model.enable:
            self.reward_model = nnx.split(build.build_reward_model(cfg, mesh))
        rollout = cfg.actor_rollout_ref.rollout
        self.gen_dtype = to_dtype(rollout.dtype)
        self.gen_shardings = state_shardings(params, self.meshes.generate, ACTOR_GENERATE_RULES)
        self.engine = Engine(actor, RolloutConfig.from_config(rollout), mesh=self.meshes.generate)
        self._update_weights()

    def _update_weights(self) -> int:
        """Re-lays the actor's weights into the generation layout; returns bytes moved."""
        params, nbytes = update_weights(self.actor_state.params, self.gen_shardings, self.gen_dtype)
        self.engine.update_weights(params)
        return nbytes

    def _sampling(self, step: int, validate: bool = False) -> SamplingParams:
        rollout = self.cfg.actor_rollout_ref.rollout
        seed = step_seed(self.cfg.trainer.seed, step, int(validate))
        return SamplingParams.from_config(rollout, validate=validate, seed=seed)

    # ------------------------------------------------------------------------------ the step

    def train_step(self, step: int) -> dict[str, Any]:
        """One RL step on the next training batch; returns its metrics on the host."""
        timing: dict[str, float] = {}
        with timed(timing, "step"):
            epoch = self.train_loader.epoch
            batch, host, greedy = self._generate(next(self.train_loader), step, timing)
            batch, device, result = self._prepare(batch, host, greedy, timing)
            device |= self._update(batch, step, timing)
            with timed(timing, "reshard"):
                nbytes = self._update_weights()
                jax.block_until_ready(self.engine.state)
            device |= _data_metrics(batch, self.use_critic)
            metrics = {k: float(v) for k, v in jax.device_get(device).items()}  # host sync
        self._count_nans(int(metrics.pop("nan_skipped")), step)
        metrics |= {k: float(v) for k, v in result.metrics.items()}
        metrics |= {f"timing_s/{k}": v for k, v in timing.items()}
        seq_lens = host.prompt_lengths + host.response_lengths
        ppo_epochs = self.stage_cfg.actor_update.ppo_epochs
        metrics |= compute_perf_metrics(
            seq_lens, timing, self.n_devices, self.actor_config, ppo_epochs, self.peak_flops
        )
        metrics |= {
            "perf/reshard_bytes": float(nbytes),
            "training/global_step": float(step),
            "training/epoch": float(epoch),
            "training/nan_skipped_updates_total": float(self.nan_total),
            "rollout/num_compiles": float(self.engine.num_compiles),
        }
        return metrics

    def _generate(self, prompts, step: int, timing):
        """Stage `gen`: rollout with the idle states offloaded (when configured), plus one
        greedy response per prompt when the advantage estimator needs a reward baseline.
        Returns (batch, host columns, (greedy batch, its host columns) or None)."""
        if self.offload_any:
            with timed(timing, "offload"):
                self._move_idle_states(offload_to_host)
        with timed(timing, "gen"):
            sampling = self._sampling(step)
            pad = self.tokenizer.pad_token_id
            batch, host = generate_batch(self.engine, prompts, sampling, pad, self.batch_sharding)
            greedy = None
            if self.greedy_baseline:
                argmax = dataclasses.replace(sampling, n=1, temperature=0.0, top_k=-1, top_p=1.0)
                greedy = generate_batch(self.engine, prompts, argmax, pad, self.batch_sharding)
        if self.offload_any:
            with timed(timing, "onload"):
                self._move_idle_states(load_to_device)
        return batch, host, greedy

    def _prepare(self, batch: RLBatch, host: HostColumns, greedy, timing):
        """Stages `reward`, `old_log_prob`, `ref`, `values`, `adv`. Scoring (rule functions in
        threads, the reward model queued) overlaps the log-prob and value passes. Returns
        (batch, device metrics, the reward manager's result)."""
        sc, device = self.stage_cfg, {}
        with timed(timing, "reward"):
            scores = self.reward.submit(batch, host)
            greedy_scores = self.reward.submit(*greedy) if greedy else None
        with timed(timing, "old_log_prob"):
            batch, m = _old_log_prob(self.actor_graphdef, self.actor_state.params, batch, sc)
            device |= jax.block_until_ready(m)
        if self.use_ref:
            with timed(timing, "ref"):
                batch = _ref_log_prob(self.actor_graphdef, self.ref_params, batch, sc)
                jax.block_until_ready(batch.ref_log_prob)
        if self.use_critic:
            with timed(timing, "values"):
                batch = _values(self.critic_graphdef, self.critic_state.params, batch, sc)
                jax.block_until_ready(batch.values)
        with timed(timing, "reward"):
            token_scores, result = self.reward.collect(scores)
            batch = batch.replace(token_level_scores=token_scores)
            if greedy_scores is not None:
                baselines = self.reward.baselines(greedy_scores, sc.group_size)
                batch = batch.replace(reward_baselines=baselines)
        with timed(timing, "adv"):
            batch, self.kl_coef, m = _advantage(batch, self.kl_coef, sc)
            device |= jax.block_until_ready(m)
        return batch, device, result

    def _update(self, batch: RLBatch, step: int, timing) -> dict[str, jax.Array]:
        """Stages `update_critic` and (after `trainer.critic_warmup` steps) `update_actor`.
        Returns their device metrics and `nan_skipped`, the skipped optimizer steps."""
        sc, device = self.stage_cfg, {}
        rng = jax.random.fold_in(jax.random.key(self.cfg.trainer.seed), step)
        nan_skipped = jnp.zeros((), jnp.int32)
        if self.use_critic:
            with timed(timing, "update_critic"):
                self.critic_state, m, nan = _update_critic(
                    self.critic_graphdef, self.critic_state, batch, rng, sc
                )
                device |= jax.block_until_ready(m)
                nan_skipped += nan
        if step > self.cfg.trainer.critic_warmup:
            with timed(timing, "update_actor"):
                self.actor_state, m, nan = _update_actor(
                    self.actor_graphdef, self.actor_state, batch, rng, sc
                )
                device |= jax.block_until_ready(m)
                nan_skipped += nan
        return device | {"nan_skipped": nan_skipped}

    def _move_idle_states(self, move) -> None:
        """Moves the states configured for offload (`*.fsdp_config.*_offload`) with `move`
        (`offload_to_host` before generation, `load_to_device` after). Host sync."""
        replace = dataclasses.replace
        actor, ref, critic = self.offload["actor"], self.offload["ref"], self.offload["critic"]
        if actor.param_offload:
            self.actor_state = replace(self.actor_state, params=move(self.actor_state.params))
        if actor.optimizer_offload:
            self.actor_state = replace(self.actor_state, opt_state=move(self.actor_state.opt_state))
        if self.use_ref and ref.param_offload:
            self.ref_params = move(self.ref_params)
        if self.use_critic and critic.param_offload:
            self.critic_state = replace(self.critic_state, params=move(self.critic_state.params))
        if self.use_critic and critic.optimizer_offload:
            self.critic_state = replace(
                self.critic_state, opt_state=move(self.critic_state.opt_state)
            )

    def _count_nans(self, skipped: int, step: int) -> None:
        self.nan_total += skipped
        self.nan_consecutive = self.nan_consecutive + 1 if skipped else 0
        if skipped:
            log.warning("step %d: %d update(s) skipped for non-finite loss or grads", step, skipped)
        limit = self.cfg.trainer.max_consecutive_nan_steps
        if self.nan_consecutive >= limit:
            raise NonFiniteLossError(
                f"{self.nan_consecutive} consecutive steps with non-finite loss or gradients "
                f"(trainer.max_consecutive_nan_steps={limit}); last at step {step}"
            )

    def validate(self) -> dict[str, float]:
        """`val-core/<data_source>/acc/mean@n` on the validation files (empty if none)."""
        if self.val_loader is None:
            return {}
        sampling = self._sampling(self.global_step, validate=True)
        return validate(
            self.engine,
            self.val_loader,
            sampling,
            self.tokenizer,
            self.reward.manager,
            self.batch_sharding,
        )

    # ------------------------------------------------------------------------------ checkpoints

    def _state_tree(self) -> dict[str, Any]:
        tree = {"actor": self.actor_state, "kl_coef": self.kl_coef}
        if self.critic_state is not None:
            tree["critic"] = self.critic_state
        return tree

    def save(self) -> None:
        """Checkpoints the current step (asynchronously; refused if any value is non-finite)."""
        meta = {
            "global_step": self.global_step,
            "data": self.train_loader.get_state(),
            "nan_consecutive": self.nan_consecutive,
            "nan_total": self.nan_total,
        }
        self.checkpointer.save(self.global_step, self._state_tree(), meta)

    def restore(self) -> int:
        """Resumes per `trainer.resume_mode`; returns the restored step (0: fresh start)."""
        mode = self.cfg.trainer.resume_mode
        if mode == "disable":
            return 0
        if mode == "auto":
            restored = self.checkpointer.restore(self._state_tree())
        else:
            directory, step = split_checkpoint_path(mode)
            source = Checkpointer(directory, self.cfg.trainer.max_actor_ckpt_to_keep)
            restored = source.restore(self._state_tree(), step)
            source.close()
        if restored is None:
            return 0
        step, tree, meta = restored
        self.actor_state, self.kl_coef = tree["actor"], tree["kl_coef"]
        self.critic_state = tree.get("critic")
        self.train_loader.set_state(meta["data"])
        self.global_step = meta["global_step"]
        self.nan_consecutive, self.nan_total = meta["nan_consecutive"], meta["nan_total"]
        self._update_weights()
        log.info("resumed from step %d", step)
        return step

    # ------------------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, Any]:
        """Trains from the restored (or first) step to `total_steps`; saves every
        `trainer.save_freq` steps, at the end, and on SIGTERM/SIGINT (then returns early).
        Returns the last step's metrics."""
        t = self.cfg.trainer
        start = self.restore()
        self.global_step = start
        log_dir = os.path.join(t.default_local_dir, "logs")
        tracker = Tracking(t.logger, log_dir, self.total_steps, start, t.progress_bar)
        metrics: dict[str, Any] = {}
        try:
            with StopRequest() as stop:
                if t.val_before_train and start == 0 and self.val_loader is not None:
                    tracker.log(self.validate(), 0)
                for step in range(start + 1, self.total_steps + 1):
                    metrics = self.train_step(step)
                    self.global_step = step
                    last = step == self.total_steps
                    if t.test_freq > 0 and (step % t.test_freq == 0 or last):
                        with timed(timing := {}, "testing"):
                            metrics |= self.validate()
                        metrics["timing_s/testing"] = timing["testing"]
                    if last or stop.requested or (t.save_freq > 0 and step % t.save_freq == 0):
                        with timed(timing := {}, "save_checkpoint"):
                            self.save()
                        metrics["timing_s/save_checkpoint"] = timing["save_checkpoint"]
                    tracker.log(metrics, step)
                    if stop.requested:
                        break
        finally:
            self.checkpointer.wait()
            tracker.close()
        return metrics

    def close(self) -> None:
        self.checkpointer.close()
        self.reward.close()
