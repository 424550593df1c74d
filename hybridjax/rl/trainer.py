"""The RL trainer: builds the run once, then loops `step.train_step` and checkpoints.

    gen → reward → old_log_prob → ref → teacher → values → adv → update_critic → update_actor
        → reshard

At construction the config is checked (`hybridjax.rl.checks`) and resolved
(`hybridjax.config.run.resolve`), the models, the rollout engine, the reward stage and the
pipeline (`step.configured_pipeline`: the config's default step plus the `trainer.stages`
edits, or one given from Python) are built, and what a step reads is frozen into
`step.StepDeps`. Each step returns the new models and KL coefficient (`step.StepState`), which
the trainer keeps and checkpoints.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import ConfigDict

from hybridjax.algorithms.advantages import needs_reward_baseline
from hybridjax.checkpointing import Checkpointer, StopRequest, split_checkpoint_path
from hybridjax.checkpointing.run_lock import hold_run_directory
from hybridjax.config.run import resolve, resolve_dtypes
from hybridjax.data.dataset import DataConfig, train_loader, val_loader
from hybridjax.metrics import Tracking, measure_peak_flops, num_compiles
from hybridjax.metrics.console import announce
from hybridjax.models.config import to_dtype
from hybridjax.rewards import RewardConfig
from hybridjax.rewards.guard import RewardFailureGuard
from hybridjax.rewards.registry import check_data_sources
from hybridjax.rl import checks, step
from hybridjax.rl.async_rollout import RolloutAhead
from hybridjax.rl.evaluation import validate
from hybridjax.rl.generation import RolloutWeights, Sampler, sampling_params
from hybridjax.rl.multi_turn import MultiTurn
from hybridjax.rl.nan_guard import NanGuard
from hybridjax.rl.partial_rollout import PartialRollout
from hybridjax.rl.pipeline import Pipeline, timed
from hybridjax.rl.reward import RewardStage, check_reward_servers
from hybridjax.rollout import Engine, RolloutConfig, SamplingParams
from hybridjax.rollout.config import run_batch_seqs
from hybridjax.sharding import (
    ACTOR_GENERATE_RULES,
    state_shardings,
)
from hybridjax.sharding.hosts import any_process, is_main, local_mesh, share
from hybridjax.training import build
from hybridjax.training.offload import offload_configs

log = logging.getLogger(__name__)


class RLTrainer:
    """PPO / GRPO / ... trainer over one device set (verl's `RayPPOTrainer`, one process).

    Args:
      cfg: a full trainer ConfigDict (`hybridjax.config.schema.base_config()` + changes).
      pipeline: the step to run; default `step.configured_pipeline(cfg)` (`trainer.stages`
        applies to the default only). Edit the default with `insert_after`, `replace`, ...
      read_only: never write to `trainer.default_local_dir` (export): no checkpoint is saved.
    Raises:
      ConfigError: the config has problems (all listed in one message).
      PipelineError: `pipeline` has a stage reading a field no earlier stage writes.
      ValueError: both `pipeline` and `trainer.stages` are given.
    """

    def __init__(self, cfg: ConfigDict, pipeline: Pipeline | None = None, read_only: bool = False):
        self.cfg = resolve_dtypes(cfg)  # `auto` dtypes for this backend, before any check
        num_compiles()  # starts counting: `perf/num_compiles` includes this run's first compiles
        self.n_devices = jax.device_count()
        checks.validate(cfg, self.n_devices)  # before any file is read or model built
        self.run_lock = None if read_only or not is_main() else hold_run_directory(cfg)
        self.tokenizer = build.load_tokenizer(cfg)
        self.actor_config = build.actor_model_config(cfg, self.tokenizer)
        models = {"actor_rollout_ref.model": self.actor_config}
        checks.validate_models(cfg, self.n_devices, models)  # head counts, memory: once each
        if pipeline is not None:
            if cfg.trainer.stages:
                raise ValueError(
                    "trainer.stages edits the default pipeline; with a pipeline given, add "
                    f"those stages to it in Python instead ({list(cfg.trainer.stages)})"
                )
            pipeline.check()
        self.pipeline = pipeline or step.configured_pipeline(cfg)
        check_reward_servers(cfg)  # fails fast, before any model is loaded
        data = dataclasses.replace(
            DataConfig.from_config(cfg.data),
            any_ground_truth=bool(cfg.custom_reward_function.path),
        )
        # each process collates, generates and scores only its share of every batch
        self.train_loader = train_loader(data, self.tokenizer, share)
        self.val_loader = val_loader(data, self.tokenizer, share) if data.val_files else None
        loaders = {"data.train_files": self.train_loader, "data.val_files": self.val_loader}
        check_data_sources(  # before any model is built
            {k: v.dataset.data_sources() for k, v in loaders.items() if v is not None},
            custom=not RewardConfig.from_config(cfg).uses_builtin,
        )
        t = cfg.trainer
        # every derived fact (roles, placement, meshes, shardings, stage configs), once
        self.run = run = resolve(cfg, self.actor_config, len(self.train_loader))
        self.placement, self.meshes, self.total_steps = run.placement, run.meshes, run.total_steps
        sc = self.stage_cfg = run.stage_cfg
        self.role_stage_cfgs = run.role_stage_cfgs
        self.batch_sharding = run.batch_sharding
        self.pool_batch_shardings = run.pool_batch_shardings
        self.use_critic, self.use_ref = run.roles.critic, run.roles.reference
        self.offload = offload_configs(cfg)
        self.models = build.build_models(
            cfg,
            self.actor_config,
            self.meshes.train,
            sc,
            self.use_ref,
            run.role_meshes,
            self.role_stage_cfgs.get("critic"),
        )
        rollout = cfg.actor_rollout_ref.rollout
        gen_shardings = state_shardings(
            self.actor_state.params, self.meshes.generate, ACTOR_GENERATE_RULES
        )
        # one generation replica per host: the engine's host loop sees only local arrays
        engine_mesh = local_mesh(self.meshes.generate)
        self.weights = RolloutWeights(
            gen_shardings,
            to_dtype(rollout.dtype),
            engine_mesh,
            self.placement.co_located,
            forward=t.rollout_mode == "sync",  # no rollout thread reads them during updates
        )
        params = self.weights.generation_params(self.actor_state.params)[0]
        engine_config = RolloutConfig.from_config(rollout, run_batch_seqs(cfg))
        self.engine = Engine(
            nnx.merge(self.actor_graphdef, params), engine_config, mesh=engine_mesh
        )
        self.weights.engine = self.engine
        self.multi_turn = MultiTurn.from_config(rollout.multi_turn, self.tokenizer)
        self.sampler = Sampler(
            self.engine,
            rollout,
            t.seed,
            self.tokenizer.pad_token_id,
            self.batch_sharding,
            self.train_loader.rows.start or 0,  # this process's share of every batch
            self.multi_turn,
            needs_reward_baseline(cfg.algorithm.adv_estimator),
        )
        judge_mesh = local_mesh(run.role_meshes.get("reward_model", self.meshes.generate))
        self.reward = RewardStage.from_config(
            cfg,
            self.tokenizer,
            self.models.reward_model,
            self.batch_sharding,
            run.data_parallel,
            self.pool_batch_shardings.get("reward_model"),
            build.build_judge(cfg, judge_mesh, t.seed),
        )
        self.rollout_ahead = self._rollout_ahead()  # None when trainer.rollout_mode is sync
        self.weights.rollout_ahead = self.rollout_ahead
        if self.rollout_ahead is not None:
            self._update_weights(0)  # the thread's first weights
            self.rollout_ahead.score_enabled = self._can_score_ahead()
        self.checkpointer = Checkpointer(
            t.default_local_dir, t.max_actor_ckpt_to_keep, read_only=read_only
        )
        self.peak_flops = t.peak_flops or measure_peak_flops()
        replicated = NamedSharding(self.meshes.train, PartitionSpec())
        self.kl_coef = jax.device_put(jnp.float32(sc.algorithm.kl_ctrl.kl_coef), replicated)
        self.deps = step.StepDeps(
            run=run,
            pipeline=self.pipeline,
            sampler=self.sampler,
            rollout_ahead=self.rollout_ahead,
            weights=self.weights,
            reward=self.reward,
            tokenizer=self.tokenizer,
            train_loader=self.train_loader,
            replicated=replicated,
            multi_turn=self.multi_turn,
            offload=self.offload,
            n_devices=self.n_devices,
            peak_flops=self.peak_flops,
        )
        self.global_step = 0
        self.policy_versions = None  # per row of the last step: the policy that sampled it
        self.token_versions = None  # per response token of the last step (partial rollouts)
        self.nan_guard = NanGuard(t.max_consecutive_nan_steps)
        self.reward_guard = RewardFailureGuard.from_config(cfg)

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
        """The `StageConfig` of `role`'s pool (see `RunConfig.stage_config_of`)."""
        return self.run.stage_config_of(role)

    def _update_weights(self, version: int | None = None) -> int:
        """Re-lays the actor's weights into the engine (or, with a rollout ahead, publishes them
        as policy `version`, default the last step); returns bytes moved."""
        version = self.global_step if version is None else version
        return self.weights.update(self.actor_state.params, version)

    # --------------------------------------------------------- placement and asynchrony (issue 16)

    def _rollout_ahead(self) -> RolloutAhead | None:
        """The rollout thread of `trainer.rollout_mode` one_step_off / async (see async_rollout)."""
        t = self.cfg.trainer
        self.partial = None
        if t.rollout_mode == "sync":
            return None
        lag = 1 if t.rollout_mode == "one_step_off" else t.staleness_threshold

        def generate(prompts, n):
            batch, host, greedy = self.sampler.sample(prompts, n)
            return (prompts, batch, host, greedy), len(host.response_lengths)

        set_weights = lambda params, version: self.engine.update_weights(params)  # noqa: E731
        if t.partial_rollout:  # carried tokens lag one round more (hybridjax.rl.partial_rollout)
            generate, set_weights, lag = self._partial_rollout()

        def score(output, n):  # while the actor trains the step before
            _, batch, host, greedy = output
            greedy_scoring = None if greedy is None else self.reward.submit(*greedy, n)
            return self.reward.submit(batch, host, n), greedy_scoring

        self._data_states = []  # loader state before each batch drawn ahead, oldest first
        self._prompts_in_flight = 0  # partial rollouts: queued, not yet handed to a step

        def next_prompts():
            self._data_states = self._data_states[-lag:] + [self.train_loader.get_state()]
            if self.partial is None:
                return next(self.train_loader)
            # partial rollouts queue one batch ahead, so that freed slots take its prompts
            # while the batch's long tail runs: each request tops the prompts in flight up to
            # this step's batch and the next one's (this step's alone at the last step),
            # counted from those a checkpoint put back (none after a run's last step)
            size = self.cfg.data.train_batch_size
            last = self.rollout_ahead.requested == self.total_steps
            batches = []
            while self._prompts_in_flight + len(batches) * size < size * (1 if last else 2):
                batches.append(next(self.train_loader))
            self._prompts_in_flight += len(batches) * size - size  # this step takes `size`
            return batches

        return RolloutAhead(generate, set_weights, next_prompts, lag, self.total_steps, score)

    def _partial_rollout(self):
        """(generate, set_weights, lag) of the rollout thread with `trainer.partial_rollout`:
        one `PartialRollout` round per step, requested one step ahead (on demand with
        staleness_threshold 1: a carried token lags one version more than a fresh one)."""
        if jax.process_count() > 1:
            raise ValueError("trainer.partial_rollout runs in one process; unset it")
        t = self.cfg.trainer
        self.partial = partial = PartialRollout(
            self.engine,
            self.cfg.actor_rollout_ref.rollout,
            t.seed,
            self.tokenizer.pad_token_id,
            self.batch_sharding,
            t.staleness_threshold,
            kv=t.partial_rollout_kv,
        )

        size = self.cfg.data.train_batch_size

        def generate(batches, n):
            for prompts in batches:
                partial.add(prompts, n)
            prompts, batch, host, versions = partial.batch(n, size)
            return (prompts, batch, host, None), versions

        return generate, partial.set_weights, min(1, t.staleness_threshold - 1)

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
        return sampling_params(rollout, self.cfg.trainer.seed, step, validate, gen_batch)

    # ------------------------------------------------------------------------------ the step

    def train_step(self, n: int) -> dict[str, Any]:
        """RL step `n` on the next training batch (`step.train_step`); returns its metrics."""
        epoch = self.train_loader.epoch
        # with a rollout ahead, the gen stage takes the prompts from the thread
        prompts = next(self.train_loader) if self.rollout_ahead is None else None
        state = step.StepState(self.models, self.kl_coef)
        preemptions = self.engine.num_preemptions
        state, metrics, ctx = step.train_step(state, prompts, self.deps, n)
        self.models, self.kl_coef = state.models, state.kl_coef
        self.policy_versions, self.token_versions = ctx.policy_versions, ctx.token_versions
        self.nan_guard.count(int(metrics.pop("nan_skipped", 0)), n)
        self.reward_guard.count(ctx.reward, n)  # raises before a checkpoint of failed steps
        metrics |= {
            "training/global_step": float(n),
            "training/epoch": float(epoch),
            "training/nan_skipped_updates_total": float(self.nan_guard.total),
            "rollout/num_compiles": float(self.engine.num_compiles),
            # sequences preempted (KV pages on demand) while the step ran, vLLM's counter
            "rollout/num_preemptions": float(self.engine.num_preemptions - preemptions),
        }
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
            params = self.weights.generation_params(self.actor_state.params)[0]
            if self.partial is None:
                self.engine.update_weights(params)  # each request sets its own
                return self._validate(sampling)
            with self.partial.paused():  # sequences in flight wait, then come back
                self.engine.update_weights(params)
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
        if self.partial is not None:  # the prompts in flight after this step's round
            meta["partial_rollout"] = self.partial.state_after(self.global_step)
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
        self.train_loader.set_state(meta["data"])
        if self.partial is not None and "partial_rollout" in meta:  # (an export needs none)
            with self.rollout_ahead.engine_lock:
                self.partial.load_state(meta["partial_rollout"])
            self._prompts_in_flight = len(self.partial.groups)
        elif in_flight := len(meta.get("partial_rollout", {}).get("groups", [])):
            log.warning(
                "the checkpoint of step %d holds %d prompts in flight of a partial-rollout run; "
                "with trainer.partial_rollout off they are not trained (the data order goes on "
                "after them)", step, in_flight,
            )  # fmt: skip
        self.global_step = meta["global_step"]
        self.nan_guard.consecutive, self.nan_guard.total = (
            meta["nan_consecutive"],
            meta["nan_total"],
        )
        self._update_weights()
        announce(log, f"resumed from step {step} of {self.cfg.trainer.default_local_dir}")
        return step

    def _meta_problems(self, meta: dict) -> list[str]:
        """How a checkpoint's data-iterator state does not fit this run's loader."""
        saved, mine = meta.get("data", {}), self.train_loader.get_state()
        keys = {
            "num_rows": "rows after filtering: data.train_files, data.filter_overlong_prompts",
            "batch_size": "data.train_batch_size",
            "seed": "data.seed",
        }
        problems = [
            f"data iterator {key}: {saved.get(key)} in the checkpoint, {mine[key]} with this "
            f"config ({why})"
            for key, why in keys.items()
            if saved.get(key) != mine[key]
        ]
        resumes = self.partial is not None and not self.checkpointer.read_only
        if resumes and "partial_rollout" not in meta:
            problems.append(
                "trainer.partial_rollout: the checkpoint has no prompts in flight (saved "
                "without partial rollouts, or by an older version)"
            )
        return problems

    # ------------------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, Any]:
        """Trains to `total_steps`, continuing after the last step this trainer ran (a
        notebook's `train_step(1)`), else from the checkpoint `trainer.resume_mode` restores (or
        the first step); saves every `trainer.save_freq` steps, at the end, and on
        SIGTERM/SIGINT (then returns early). Returns the last step's metrics (empty, and
        nothing trained or written, when the start is already `total_steps`: it says so)."""
        t = self.cfg.trainer
        start = self.global_step or self.restore()
        self.global_step = start
        if start >= self.total_steps:
            announce(
                log,
                f"no steps left: the run is at step {start} and trains {self.total_steps} "
                "steps (trainer.total_training_steps, or total_epochs); nothing to train",
            )
            return {}
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
                    if (last or stopping or periodic) and self.reward_guard.may_save():
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
        if self.run_lock is not None:
            self.run_lock.release()
