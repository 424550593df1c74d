"""The RL trainer: one controller running the step's pipeline of named stages.

    gen → reward → old_log_prob → ref → values → adv → update_critic → update_actor → reshard

The pipeline (`trainer.step.configured_pipeline`: the config's default step plus the
`trainer.stages` edits, or one given from Python) is built and checked at construction. Each
stage is timed as `timing_s/<stage>`. Metrics of a step are pulled to the host in one
`device_get`.
"""

from __future__ import annotations

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
from hybridjax.metrics import Tracking, compute_perf_metrics, measure_peak_flops, num_compiles
from hybridjax.models.config import to_dtype
from hybridjax.rollout import Engine, RolloutConfig, SamplingParams
from hybridjax.sharding import (
    ACTOR_GENERATE_RULES,
    state_shardings,
)
from hybridjax.sharding.hosts import any_process, is_main, local_mesh, share, to_local
from hybridjax.sharding.pools import make_placement, sync_weights
from hybridjax.trainer import build, step
from hybridjax.trainer.async_rollout import RolloutAhead, staleness_metrics
from hybridjax.trainer.generation import generate_batch, step_seed
from hybridjax.trainer.multi_turn import MultiTurn, multi_turn_metrics
from hybridjax.trainer.nan_guard import NanGuard
from hybridjax.trainer.offload import offload_configs
from hybridjax.trainer.pipeline import Pipeline, Stage, StepContext, timed
from hybridjax.trainer.reward import RewardStage, check_reward_servers
from hybridjax.trainer.validate import validate as validate_config
from hybridjax.trainer.validation import generation_samples, validate

log = logging.getLogger(__name__)


class RLTrainer:
    """PPO / GRPO / ... trainer over one device set (verl's `RayPPOTrainer`, one process).

    Args:
      cfg: a full trainer ConfigDict (`hybridjax.trainer.config.base_config()` + changes).
      pipeline: the step to run; default `step.configured_pipeline(cfg)` (`trainer.stages`
        applies to the default only). Edit the default with `insert_after`, `replace`, ...
      read_only: never write to `trainer.default_local_dir` (export): no checkpoint is saved.
    Raises:
      ConfigError: the config has problems (all listed in one message).
      PipelineError: `pipeline` has a stage reading a field no earlier stage writes.
      ValueError: both `pipeline` and `trainer.stages` are given.
    """

    def __init__(self, cfg: ConfigDict, pipeline: Pipeline | None = None, read_only: bool = False):
        self.cfg = cfg
        num_compiles()  # starts counting: `perf/num_compiles` includes this run's first compiles
        self.n_devices = jax.device_count()
        validate_config(cfg, self.n_devices)  # before any file is read or model built
        self.tokenizer = build.load_tokenizer(cfg)
        self.actor_config = build.actor_model_config(cfg, self.tokenizer)
        validate_config(cfg, self.n_devices, {"actor_rollout_ref.model": self.actor_config})
        if pipeline is not None:
            if cfg.trainer.stages:
                raise ValueError(
                    "trainer.stages edits the default pipeline; with a pipeline given, add "
                    f"those stages to it in Python instead ({list(cfg.trainer.stages)})"
                )
            pipeline.check()
        self.pipeline = pipeline or step.configured_pipeline(cfg)
        check_reward_servers(cfg)  # fails fast, before any model is loaded
        # placement: training mesh of the actor's pool, generation mesh of the rollout's pool
        self.placement = make_placement(cfg)
        self.meshes = self.placement.meshes()
        dp = self.meshes.train.shape["data"] * self.meshes.train.shape["fsdp"]
        self.batch_sharding = NamedSharding(self.meshes.train, PartitionSpec(("data", "fsdp")))

        data = dataclasses.replace(
            DataConfig.from_config(cfg.data),
            any_ground_truth=bool(cfg.custom_reward_function.path),
        )
        # each process collates, generates and scores only its share of every batch
        self.train_loader = train_loader(data, self.tokenizer, share)
        self.val_loader = val_loader(data, self.tokenizer, share) if data.val_files else None
        t = cfg.trainer
        self.total_steps = (
            t.total_training_steps
            if t.total_training_steps > 0
            else len(self.train_loader) * t.total_epochs
        )
        self.stage_cfg = sc = build.stage_config(cfg, self.total_steps, dp, self.actor_config)
        self.use_critic = cfg.critic.enable
        self.use_ref = sc.actor_loss.use_kl_loss or sc.algorithm.use_kl_in_reward
        self.offload = offload_configs(cfg)
        # ref, critic, reward model on pools of their own (placement.<role>): their meshes,
        # the batch axes their inputs move to, and the stage config of their data parallelism
        role_meshes = {
            role: self.placement.train_mesh(role)
            for role in ("ref", "critic", "reward_model")
            if self.placement.roles[role] != self.placement.roles["actor"]
        }
        self.pool_batch_shardings = {
            role: NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
            for role, mesh in role_meshes.items()
        }
        self.role_stage_cfgs = {
            role: build.stage_config(
                cfg, self.total_steps, mesh.shape["data"] * mesh.shape["fsdp"], self.actor_config
            )
            for role, mesh in role_meshes.items()
            if role in ("ref", "critic")
        }
        self.models = build.build_models(
            cfg,
            self.actor_config,
            self.meshes.train,
            sc,
            self.use_ref,
            role_meshes,
            self.role_stage_cfgs.get("critic"),
        )
        rollout = cfg.actor_rollout_ref.rollout
        self.gen_dtype = to_dtype(rollout.dtype)
        self.gen_shardings = state_shardings(
            self.actor_state.params, self.meshes.generate, ACTOR_GENERATE_RULES
        )
        engine_config = RolloutConfig.from_config(rollout)
        # one generation replica per host: the engine's host loop sees only local arrays
        self.engine_mesh = local_mesh(self.meshes.generate)
        actor = nnx.merge(self.actor_graphdef, self._generation_params()[0])
        self.engine = Engine(actor, engine_config, mesh=self.engine_mesh)
        self.multi_turn = MultiTurn.from_config(rollout.multi_turn, self.tokenizer)
        self.rollout_ahead = self._rollout_ahead()  # None when trainer.rollout_mode is sync
        self.weights_version = 0  # actor updates in the weights the rollout has
        if self.rollout_ahead is not None:
            self._update_weights()  # the thread's first weights
            self.pipeline = self.pipeline.replace(
                "gen", Stage("gen", self._gen_ahead, writes=step.GENERATED)
            )
        self.reward = RewardStage.from_config(
            cfg,
            self.tokenizer,
            self.models.reward_model,
            self.batch_sharding,
            dp,
            self.pool_batch_shardings.get("reward_model"),
        )
        if self.rollout_ahead is not None:
            self.rollout_ahead.score_enabled = self._can_score_ahead()
        self.checkpointer = Checkpointer(
            t.default_local_dir, t.max_actor_ckpt_to_keep, read_only=read_only
        )
        self.peak_flops = t.peak_flops or measure_peak_flops()
        replicated = NamedSharding(self.meshes.train, PartitionSpec())
        self.kl_coef = jax.device_put(jnp.float32(cfg.algorithm.kl_ctrl.kl_coef), replicated)
        self.global_step = 0
        self.nan_guard = NanGuard(t.max_consecutive_nan_steps)

    @property
    def actor_graphdef(self):
        return self.models.actor_graphdef

    @property
    def actor_state(self):
        return self.models.actor_state

    @property
    def critic_state(self):
        return self.models.critic_state

    def stage_config_of(self, role: str):
        """The `StageConfig` of `role`'s pool (`ref`, `critic`): micro-batches and packing follow
        that pool's data parallelism; the actor's `stage_cfg` when they share a pool."""
        return self.role_stage_cfgs.get(role, self.stage_cfg)

    def _generation_params(self) -> tuple[Any, int]:
        """The actor's weights re-laid into the rollout pool's generation layout, as this
        host's replica's arrays, and the bytes moved. Split pools time the move as
        `timing_s/update_weights`."""
        start = time.perf_counter()
        params, nbytes = sync_weights(self.actor_state.params, self.gen_shardings, self.gen_dtype)
        if not self.placement.co_located:
            jax.block_until_ready(params)
            self._sync_time = time.perf_counter() - start
        return to_local(params, self.engine_mesh), nbytes

    def _update_weights(self) -> int:
        """Re-lays the actor's weights into the engine (or, with a rollout ahead, publishes them
        as `weights_version`); returns bytes moved."""
        params, nbytes = self._generation_params()
        if self.rollout_ahead is None:
            self.engine.update_weights(params)
        else:
            self.rollout_ahead.publish(params, self.weights_version)
        return nbytes

    # --------------------------------------------------------- placement and asynchrony (issue 16)

    def _rollout_ahead(self) -> RolloutAhead | None:
        """The rollout thread of `trainer.rollout_mode` one_step_off / async (see async_rollout)."""
        t = self.cfg.trainer
        if t.rollout_mode == "sync":
            return None
        lag = 1 if t.rollout_mode == "one_step_off" else t.staleness_threshold

        def generate(prompts, n):
            batch, host, greedy = self._rollout(prompts, n)
            return (prompts, batch, host, greedy), len(host.response_lengths)

        def score(output, n):  # while the actor trains the step before
            _, batch, host, greedy = output
            greedy_scoring = None if greedy is None else self.reward.submit(*greedy, n)
            return self.reward.submit(batch, host, n), greedy_scoring

        self._data_states = []  # loader state before each batch drawn ahead, oldest first

        def next_prompts():
            self._data_states = self._data_states[-lag:] + [self.train_loader.get_state()]
            return next(self.train_loader)

        return RolloutAhead(
            generate, self.engine.update_weights, next_prompts, lag, self.total_steps, score
        )

    def _can_score_ahead(self) -> bool:
        """Whether the rollout thread starts scoring each batch right after generating it, so
        the rule functions (and a reward model on its own pool) score batch k+1 while step k
        trains: with a rollout ahead, when the pipeline's `reward` stage is the default one and
        directly follows `gen` (no stage in between may change the batch), and a reward model
        on devices has a pool other than the actor's (else its forward would share the devices
        of the actor's update). The scores are the same either way."""
        if self.rollout_ahead is None or "reward" not in self.pipeline.names:
            return False
        i = self.pipeline.names.index("reward")
        default = self.pipeline.stages[i] in (step.REWARD, step.REWARD_WITH_BASELINE)
        after_gen = i > 0 and self.pipeline.names[i - 1] == "gen"
        model_apart = self.models.reward_model is None or "reward_model" in (
            self.pool_batch_shardings
        )
        return default and after_gen and model_apart

    def _rollout(self, prompts, n: int):
        """One batch of samples (+ greedy responses when the estimator needs a baseline), on
        the rollout thread: the `gen` stage's work, with the weights of the request."""
        sampling = self.sampling(n)
        pad, first = self.tokenizer.pad_token_id, self.train_loader.rows.start or 0
        mt = self.multi_turn
        batch, host = generate_batch(
            self.engine, prompts, sampling, pad, self.batch_sharding, first, mt
        )
        greedy = None
        if needs_reward_baseline(self.cfg.algorithm.adv_estimator):
            argmax = dataclasses.replace(sampling, n=1, temperature=0.0, top_k=-1, top_p=1.0)
            greedy = generate_batch(
                self.engine, prompts, argmax, pad, self.batch_sharding, first, mt
            )
        return batch, host, greedy

    def _gen_ahead(self, batch, ctx: StepContext):
        """The `gen` stage with a rollout ahead: takes step `ctx.step`'s batch from the thread
        (the stage's time is the wait); the thread's generation time is `timing_s/rollout_gen`,
        the staleness `async/staleness_*`."""
        rollout = self.rollout_ahead.take(ctx.step, ctx.timing)
        ctx.timing["rollout_gen"] = rollout.timing["gen"]
        ctx.timing["wait_update"] = rollout.timing["wait_update"]
        self.policy_versions = rollout.versions
        ctx.metrics |= staleness_metrics(rollout.versions, ctx.step)
        ctx.prompts, batch, ctx.host, ctx.greedy = rollout.output
        ctx.scoring = rollout.scoring
        if self.multi_turn is not None:
            h = ctx.host
            ctx.metrics |= multi_turn_metrics(h.num_turns, h.tool_calls, h.tool_errors, h.row_mask)
        return batch

    def _data_state(self) -> Any:
        """The loader state after the last trained batch: batches drawn ahead of training are
        drawn again after a restore."""
        ahead = self.rollout_ahead.requested - self.global_step if self.rollout_ahead else 0
        if ahead > 0:
            return self._data_states[-ahead]
        return self.train_loader.get_state()

    def sampling(self, step: int, validate: bool = False, gen_batch: int = 0) -> SamplingParams:
        """Sampling of step `step`'s generation batch `gen_batch` (several with dynamic
        sampling), or of validation: each with its own seed."""
        rollout = self.cfg.actor_rollout_ref.rollout
        salt = 1 if validate else gen_batch + (gen_batch > 0)  # 0, 2, 3, ...
        seed = step_seed(self.cfg.trainer.seed, step, salt)
        return SamplingParams.from_config(rollout, validate=validate, seed=seed)

    # ------------------------------------------------------------------------------ the step

    def train_step(self, n: int) -> dict[str, Any]:
        """RL step `n` on the next training batch: runs the pipeline; returns its metrics."""
        ctx = StepContext(step=n, trainer=self)
        with timed(ctx.timing, "step"):
            epoch = self.train_loader.epoch
            self.weights_version = n  # this step's update makes policy version n
            if self.rollout_ahead is None:  # else the gen stage takes them from the thread
                ctx.prompts = next(self.train_loader)
            batch = self.pipeline.run(ctx)
            ctx.metrics |= step.data_metrics(batch, self.use_critic)
            metrics = {k: float(v) for k, v in jax.device_get(ctx.metrics).items()}  # host sync
        self.nan_guard.count(int(metrics.pop("nan_skipped", 0)), n)
        metrics |= {f"timing_s/{k}": v for k, v in ctx.timing.items()}
        if not self.placement.co_located:
            metrics["timing_s/update_weights"] = self._sync_time
        seq_lens = ctx.host.prompt_lengths + ctx.host.response_lengths
        metrics |= compute_perf_metrics(
            seq_lens,
            ctx.timing,
            self.n_devices,
            self.actor_config,
            self.stage_cfg.actor_update.ppo_epochs,
            self.peak_flops,
        )
        metrics |= {
            "training/global_step": float(n),
            "training/epoch": float(epoch),
            "training/nan_skipped_updates_total": float(self.nan_guard.total),
            "rollout/num_compiles": float(self.engine.num_compiles),
        }
        if k := self.cfg.trainer.log_train_generations:
            scores = ctx.reward.scores  # (no filter_groups: these rows are ctx.prompts')
            samples = generation_samples(self.tokenizer, ctx.prompts, ctx.host, scores, k)
            metrics["train/generations"] = samples
        self.global_step = n
        return metrics

    def validate(self) -> dict[str, Any]:
        """`val-core/<data_source>/acc/mean@N` etc. on the validation files (empty if none),
        plus `val/generations` with `trainer.log_val_generations`."""
        if self.val_loader is None:
            return {}
        sampling = self.sampling(self.global_step, validate=True)
        if self.rollout_ahead is None:
            return self._validate(sampling)
        with self.rollout_ahead.engine_lock:  # waits for the batch being generated
            self.engine.update_weights(self._generation_params()[0])  # each request sets its own
            return self._validate(sampling)

    def _validate(self, sampling: SamplingParams) -> dict[str, Any]:
        return validate(
            self.engine,
            self.val_loader,
            sampling,
            self.tokenizer,
            self.reward.manager,
            self.batch_sharding,
            self.cfg.trainer.log_val_generations,
            self.val_loader.rows.start or 0,
            self.multi_turn,
        )

    # ------------------------------------------------------------------------------ checkpoints

    def _state_tree(self) -> dict[str, Any]:
        tree = {"actor": build.checkpointed(self.actor_state), "kl_coef": self.kl_coef}
        if self.critic_state is not None:
            tree["critic"] = build.checkpointed(self.critic_state)
        return tree

    def save(self) -> None:
        """Checkpoints the current step (asynchronously; refused if any value is non-finite)."""
        meta = {
            "global_step": self.global_step,
            "data": self._data_state(),
            "nan_consecutive": self.nan_guard.consecutive,
            "nan_total": self.nan_guard.total,
        }
        self.checkpointer.save(self.global_step, self._state_tree(), meta)

    def restore(self) -> int:
        """Resumes per `trainer.resume_mode`; returns the restored step (0: fresh start).

        Raises:
          CheckpointError: the checkpoint does not match this config (tensors, or the data
            iterator's dataset size / batch size / seed), or an explicit path is missing or
            unreadable. Unreadable checkpoints under `auto` are skipped (see `Checkpointer`).
        """
        mode = self.cfg.trainer.resume_mode
        if mode == "disable":
            return 0
        if mode == "auto":
            restored = self.checkpointer.restore(self._state_tree(), check_meta=self._meta_problems)
        else:
            directory, step = split_checkpoint_path(mode)
            source = Checkpointer(directory, 1, read_only=True)
            try:
                restored = source.restore(self._state_tree(), step, self._meta_problems)
            finally:
                source.close()
        if restored is None:
            return 0
        step, tree, meta = restored
        critic = tree.get("critic")
        self.models = dataclasses.replace(
            self.models,
            actor_state=build.restored(self.actor_state, tree["actor"]),
            critic_state=None if critic is None else build.restored(self.critic_state, critic),
        )
        self.kl_coef = tree["kl_coef"]
        self.weights_version = meta["global_step"]
        self.train_loader.set_state(meta["data"])
        self.global_step = meta["global_step"]
        self.nan_guard.consecutive, self.nan_guard.total = (
            meta["nan_consecutive"],
            meta["nan_total"],
        )
        self._update_weights()
        log.info("resumed from step %d", step)
        return step

    def _meta_problems(self, meta: dict) -> list[str]:
        """How a checkpoint's data-iterator state does not fit this run's loader."""
        saved, mine = meta.get("data", {}), self.train_loader.get_state()
        keys = {
            "num_rows": "rows after filtering: data.train_files, data.filter_overlong_prompts",
            "batch_size": "data.train_batch_size",
            "seed": "data.seed",
        }
        return [
            f"data iterator {key}: {saved.get(key)} in the checkpoint, {mine[key]} with this "
            f"config ({why})"
            for key, why in keys.items()
            if saved.get(key) != mine[key]
        ]

    # ------------------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, Any]:
        """Trains to `total_steps`, continuing after the last step this trainer ran (a
        notebook's `train_step(1)`), else from the checkpoint `trainer.resume_mode` restores (or
        the first step); saves every `trainer.save_freq` steps, at the end, and on
        SIGTERM/SIGINT (then returns early). Returns the last step's metrics."""
        t = self.cfg.trainer
        start = self.global_step or self.restore()
        self.global_step = start
        log_dir = os.path.join(t.default_local_dir, "logs")
        tracker = Tracking(
            t.logger if is_main() else (),  # one process writes the logs
            log_dir,
            self.total_steps,
            start,
            t.progress_bar,
            run_name=(t.project_name, t.experiment_name),
            config=self.cfg.to_dict(),
        )
        metrics: dict[str, Any] = {}
        try:
            with StopRequest() as stop:
                if t.val_before_train and start == 0 and self.val_loader is not None:
                    tracker.log(self.validate(), 0)
                for step in range(start + 1, self.total_steps + 1):
                    metrics = self.train_step(step)
                    if step == 1:  # what loading dropped or cut (logged at every start)
                        metrics |= self._data_metrics()
                    self.global_step = step
                    stopping = any_process(stop.requested)  # every process stops together
                    last = step == self.total_steps
                    if t.test_freq > 0 and (step % t.test_freq == 0 or last):
                        with timed(timing := {}, "testing"):
                            metrics |= self.validate()
                        metrics["timing_s/testing"] = timing["testing"]
                    periodic = t.save_freq > 0 and step % t.save_freq == 0
                    if last or stopping or periodic:
                        with timed(timing := {}, "save_checkpoint"):
                            self.save()
                        metrics["timing_s/save_checkpoint"] = timing["save_checkpoint"]
                    tracker.log(metrics, step)
                    if stopping:
                        log.warning(
                            "stopped after step %d of %d; checkpoint saved under %s (run the "
                            "same command to resume)",
                            step,
                            self.total_steps,
                            t.default_local_dir,
                        )
                        break
        finally:
            self.checkpointer.wait()
            tracker.close()
        return metrics

    def _data_metrics(self) -> dict[str, float]:
        """`data/{train,val}/{filtered_prompts,truncated_prompts,special_token_rows}`."""
        loaders = {"train": self.train_loader, "val": self.val_loader}
        return {
            f"data/{split}/{key}": float(value)
            for split, loader in loaders.items()
            if loader is not None
            for key, value in loader.dataset.counts().items()
        }

    def close(self) -> None:
        if self.rollout_ahead is not None:
            self.rollout_ahead.close()
        self.checkpointer.close()
        self.reward.close()
