"""Start-of-run config validation: every problem found, reported in one message.

Checks, in order: unknown keys (against `base_config()`), value types, ranges and choices
(dtypes, attention kernels, reward error policy, rollout engine, multi-turn limits and tool
config file), divisibility of the batch sizes, lengths, the paths a run reads or writes (data
files, `trainer.resume_mode`, `trainer.default_local_dir`) and the custom reward function (the
file imports, the function exists and accepts verl's arguments). Registries (advantage
estimators, policy losses) are asked for their valid names, so the check never disagrees with
what the step can run. It runs before any model is built.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from hybridjax.algorithms.advantages import (
    ADV_ESTIMATORS,
    compute_advantage,
    needs_reward_baseline,
)
from hybridjax.algorithms.config import KL_CTRL_TYPES, ROLLOUT_IS_LEVELS, ROLLOUT_IS_MODES
from hybridjax.algorithms.kl import KL_PENALTY_TYPES as KL_TYPES
from hybridjax.algorithms.loss_agg import LOSS_AGG_MODES
from hybridjax.algorithms.losses import POLICY_LOSSES
from hybridjax.checkpointing.manager import STEP_PREFIX, split_checkpoint_path
from hybridjax.config.schema import base_config
from hybridjax.data.dataset import SPECIAL_TOKENS_IN_CONTENT, as_file_list
from hybridjax.errors import CheckpointError, ConfigError
from hybridjax.memory.planner import memory_problems
from hybridjax.metrics.tracking import LOGGERS, missing_logger_packages
from hybridjax.models.config import DTYPE_NAMES, ModelConfig
from hybridjax.models.lora import LoRAConfig
from hybridjax.rewards.manager import (
    COMBINE,
    ON_ERROR_POLICIES,
    REWARD_MANAGERS,
    overlong_enabled,
)
from hybridjax.rewards.registry import load_custom_reward_function
from hybridjax.rewards.scoring import check_signature
from hybridjax.rl import step
from hybridjax.rl.build import RECOMPUTE_OLD_LOG_PROB, algorithm_config, off_policy_reasons
from hybridjax.rl.multi_turn import config_problems as multi_turn_problems
from hybridjax.rl.packing import packing_problems
from hybridjax.rollout.config import ATTENTION_IMPLS
from hybridjax.sharding import MeshConfig, parallelism_problems
from hybridjax.sharding.pools import ROLES, placement_problems, pool_config, pool_sizes
from hybridjax.sharding.validate import head_count_problems

TRUNCATIONS = ("error", "left", "right", "middle")
REF_DTYPE = "actor_rollout_ref.ref.fsdp_config.model_dtype"
ROLLOUT_NAMES = ("hybridjax",)  # the built-in paged engine; verl's vllm/sglang are not used
RESUME_MODES = ("auto", "disable")  # or a .../global_step_<N> path
WARMUP_STYLES = ("constant", "cosine")
MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
FREE_FORM = ("override_config", "reward_kwargs", "resource_pool")
ROLLOUT_MODES = ("sync", "one_step_off", "async")  # dict-valued keys, checked as a whole


def _walk(cfg: ConfigDict, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if isinstance(value, ConfigDict | dict) and key not in FREE_FORM:
            yield from _walk(ConfigDict(value) if isinstance(value, dict) else value, path + ".")
        else:
            yield path, value


def _get(cfg: ConfigDict, path: str) -> Any:
    for part in path.split("."):
        cfg = cfg[part]
    return cfg


def _type_problem(key: str, value: Any, default: Any) -> str | None:
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(value, bool) and isinstance(default, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int)
    elif isinstance(default, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif isinstance(default, tuple | list):
        ok = isinstance(value, tuple | list)
    else:
        ok = isinstance(value, type(default))
    if ok:
        return None
    return f"{key}: expected {type(default).__name__}, got {type(value).__name__} ({value!r})"


def _schema_problems(cfg: ConfigDict) -> list[str]:
    schema = dict(_walk(base_config()))
    given = dict(_walk(cfg))
    problems = [
        f"{key}: missing (start from hybridjax.config.schema.base_config(); default {value!r})"
        for key, value in schema.items()
        if key not in given
    ]
    for key, value in given.items():
        if key not in schema:
            problems.append(f"{key}: unknown key ({value!r})")
            continue
        if key.endswith("reward_kwargs") or key == "resource_pool":  # see sharding.pools
            continue
        if key.endswith("override_config"):
            unknown = sorted(set(dict(value)) - MODEL_FIELDS)
            if unknown:
                problems.append(f"{key}: unknown model fields {unknown}")
            continue
        problem = _type_problem(key, value, schema[key])
        if problem:
            problems.append(problem)
    return problems


def _range_rules(c: ConfigDict) -> list[tuple[str, Callable[[Any], bool], str]]:
    positive = lambda v: v > 0
    rules = [
        ("data.train_batch_size", positive, "must be > 0"),
        ("data.max_prompt_length", positive, "must be > 0"),
        ("data.max_response_length", positive, "must be > 0"),
        ("data.truncation", lambda v: v in TRUNCATIONS, f"must be one of {TRUNCATIONS}"),
        ("data.train_files", lambda v: bool(v), "must name at least one parquet file"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", positive, "must be > 0"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", positive, "must be > 0"),
        ("actor_rollout_ref.actor.ppo_epochs", positive, "must be > 0"),
        (
            "actor_rollout_ref.actor.recompute_old_log_prob",
            lambda v: v in RECOMPUTE_OLD_LOG_PROB,
            f"one of {RECOMPUTE_OLD_LOG_PROB} (strings)",
        ),
        ("actor_rollout_ref.actor.grad_clip", positive, "must be > 0"),
        ("actor_rollout_ref.actor.clip_ratio", lambda v: 0 < v < 1, "must be in (0, 1)"),
        (
            "actor_rollout_ref.actor.clip_ratio_low",
            lambda v: 0 <= v < 1,
            "must be in (0, 1), or 0 to follow clip_ratio",
        ),
        (
            "actor_rollout_ref.actor.clip_ratio_high",
            lambda v: v >= 0,
            "must be > 0, or 0 to follow clip_ratio",
        ),
        ("actor_rollout_ref.actor.clip_ratio_c", lambda v: v > 1, "must be > 1"),
        ("actor_rollout_ref.actor.entropy_coeff", lambda v: v >= 0, "must be >= 0"),
        ("actor_rollout_ref.actor.kl_loss_coef", lambda v: v >= 0, "must be >= 0"),
        ("actor_rollout_ref.actor.kl_loss_type", lambda v: v in KL_TYPES, f"one of {KL_TYPES}"),
        ("actor_rollout_ref.model.dtype", lambda v: v in DTYPE_NAMES, f"one of {DTYPE_NAMES}"),
        ("actor_rollout_ref.rollout.dtype", lambda v: v in DTYPE_NAMES, f"one of {DTYPE_NAMES}"),
        (REF_DTYPE, lambda v: v in DTYPE_NAMES, f"one of {DTYPE_NAMES}"),
        ("reward_model.model.dtype", lambda v: v in DTYPE_NAMES, f"one of {DTYPE_NAMES}"),
        (
            "actor_rollout_ref.rollout.attention_impl",
            lambda v: v in ATTENTION_IMPLS,
            f"one of {ATTENTION_IMPLS}",
        ),
        (
            "actor_rollout_ref.rollout.name",
            lambda v: v in ROLLOUT_NAMES,
            f"one of {ROLLOUT_NAMES} (the built-in paged engine)",
        ),
        (
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
            positive,
            "must be > 0",
        ),
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", positive, "must be > 0"),
        (
            "data.special_tokens_in_content",
            lambda v: v in SPECIAL_TOKENS_IN_CONTENT,
            f"one of {SPECIAL_TOKENS_IN_CONTENT}",
        ),
        ("actor_rollout_ref.rollout.n", positive, "must be > 0"),
        ("actor_rollout_ref.rollout.temperature", lambda v: v >= 0, "must be >= 0"),
        ("actor_rollout_ref.rollout.top_p", lambda v: 0 < v <= 1, "must be in (0, 1]"),
        ("actor_rollout_ref.rollout.page_size", positive, "must be > 0"),
        (
            "actor_rollout_ref.rollout.gpu_memory_utilization",
            lambda v: 0 < v <= 1,
            "must be in (0, 1]",
        ),
        ("critic.ppo_micro_batch_size_per_gpu", positive, "must be > 0"),
        ("critic.ppo_mini_batch_size", positive, "must be > 0"),
        ("critic.ppo_epochs", positive, "must be > 0"),
        ("critic.grad_clip", positive, "must be > 0"),
        ("critic.cliprange_value", positive, "must be > 0"),
        ("algorithm.gamma", lambda v: 0 <= v <= 1, "must be in [0, 1]"),
        ("algorithm.lam", lambda v: 0 <= v <= 1, "must be in [0, 1]"),
        ("algorithm.kl_ctrl.type", lambda v: v in KL_CTRL_TYPES, " or ".join(KL_CTRL_TYPES)),
        ("algorithm.kl_ctrl.kl_coef", lambda v: v >= 0, "must be >= 0"),
        ("algorithm.kl_penalty", lambda v: v in KL_TYPES, f"one of {KL_TYPES}"),
        ("algorithm.kl_ctrl.target_kl", positive, "must be > 0"),
        ("algorithm.kl_ctrl.horizon", positive, "must be > 0"),
        ("algorithm.rollout_is_threshold", lambda v: v >= 0, "must be >= 0 (0: off)"),
        ("algorithm.rollout_is_threshold_lower", lambda v: v >= 0, "must be >= 0 (0: 1/upper)"),
        ("algorithm.rollout_is_veto_threshold", lambda v: v >= 0, "must be >= 0 (0: off)"),
        (
            "algorithm.rollout_is_level",
            lambda v: v in ROLLOUT_IS_LEVELS,
            f"one of {ROLLOUT_IS_LEVELS}",
        ),
        (
            "algorithm.rollout_is_mode",
            lambda v: v in ROLLOUT_IS_MODES,
            f"one of {ROLLOUT_IS_MODES}",
        ),
        (
            "reward_model.reward_manager",
            lambda v: v in REWARD_MANAGERS,
            f"one of {REWARD_MANAGERS}",
        ),
        ("reward_model.on_error", lambda v: v in ON_ERROR_POLICIES, f"one of {ON_ERROR_POLICIES}"),
        ("reward_model.combine", lambda v: v in COMBINE, f"one of {COMBINE}"),
        ("reward_model.num_workers", positive, "must be > 0"),
        ("reward_model.timeout_s", lambda v: v >= 0, "must be >= 0 (0: no limit)"),
        ("reward_model.remote.timeout_s", positive, "must be > 0"),
        ("reward_model.remote.max_retries", lambda v: v >= 0, "must be >= 0"),
        ("reward_model.remote.retry_backoff_s", lambda v: v >= 0, "must be >= 0"),
        ("reward_model.max_consecutive_failed_steps", positive, "must be > 0"),
        ("reward_model.remote.concurrency", positive, "must be > 0"),
        ("reward_model.remote.batch_size", positive, "must be > 0"),
        ("reward_model.overlong_buffer.len", lambda v: v >= 0, "must be >= 0"),
        ("reward_model.overlong_buffer.penalty_factor", lambda v: v >= 0, "must be >= 0"),
        ("trainer.total_epochs", positive, "must be > 0"),
        ("trainer.logger", lambda v: set(v) <= set(LOGGERS), f"a subset of {LOGGERS}"),
        ("trainer.max_actor_ckpt_to_keep", positive, "must be > 0"),
        ("trainer.max_consecutive_nan_steps", positive, "must be > 0"),
        ("trainer.critic_warmup", lambda v: v >= 0, "must be >= 0"),
        ("trainer.rollout_mode", lambda v: v in ROLLOUT_MODES, f"one of {ROLLOUT_MODES}"),
        ("trainer.staleness_threshold", lambda v: v >= 0, "must be >= 0"),
        ("trainer.peak_flops", lambda v: v >= 0, "must be >= 0"),
        ("trainer.device_memory_fraction", lambda v: 0 < v <= 1, "must be in (0, 1]"),
        ("trainer.total_training_steps", lambda v: v == -1 or v > 0, "must be -1 or > 0"),
        ("trainer.save_freq", lambda v: v == -1 or v > 0, "must be -1 or > 0"),
        ("trainer.test_freq", lambda v: v == -1 or v > 0, "must be -1 or > 0"),
        ("trainer.log_val_generations", lambda v: v >= 0, "must be >= 0"),
        ("trainer.log_train_generations", lambda v: v >= 0, "must be >= 0"),
        ("actor_rollout_ref.rollout.val_kwargs.n", positive, "must be > 0"),
    ]
    for role in ("actor_rollout_ref.actor", "critic"):
        rules += [
            (f"{role}.loss_agg_mode", lambda v: v in LOSS_AGG_MODES, f"one of {LOSS_AGG_MODES}"),
            (f"{role}.optim.lr", lambda v: v >= 0, "must be >= 0"),
            (f"{role}.optim.weight_decay", lambda v: v >= 0, "must be >= 0"),
            (f"{role}.optim.warmup_style", lambda v: v in WARMUP_STYLES, f"one of {WARMUP_STYLES}"),
            (f"{role}.optim.lr_warmup_steps_ratio", lambda v: 0 <= v <= 1, "must be in [0, 1]"),
            (f"{role}.optim.min_lr_ratio", lambda v: 0 <= v <= 1, "must be in [0, 1]"),
        ]
    registries = (
        ("algorithm.adv_estimator", ADV_ESTIMATORS.names()),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", POLICY_LOSSES.names()),
    )
    for key, names in registries:
        rules.append((key, lambda v, names=names: v in names, f"one of {list(names)}"))
    return rules


def _structure_problems(c: ConfigDict, n_devices: int) -> list[str]:
    a, d = c.actor_rollout_ref, c.data
    n = a.rollout.n
    problems = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    bsz, dp = d.train_batch_size, _data_parallel_size(c, n_devices)
    roles = [("actor_rollout_ref.actor", a.actor)]
    if c.critic.enable:  # a disabled critic's batch sizes are never used
        roles.append(("critic", c.critic))
    for role, section in roles:
        mini, micro = section.ppo_mini_batch_size, section.ppo_micro_batch_size_per_gpu
        need(
            mini <= 0 or bsz % mini == 0,
            f"data.train_batch_size ({bsz}) must be divisible by {role}.ppo_mini_batch_size "
            f"({mini})",
        )
        if mini > 0 and micro > 0 and dp > 0:
            need(
                (mini * n) % (micro * dp) == 0,
                f"{role}.ppo_mini_batch_size × rollout.n ({mini} × {n} = {mini * n} responses) "
                f"must be divisible by {role}.ppo_micro_batch_size_per_gpu × data-parallel size "
                f"({micro} × {dp} = {micro * dp})",
            )
    need(
        a.rollout.prompt_length == d.max_prompt_length,
        f"actor_rollout_ref.rollout.prompt_length ({a.rollout.prompt_length}) must equal "
        f"data.max_prompt_length ({d.max_prompt_length})",
    )
    need(
        a.rollout.response_length == d.max_response_length,
        f"actor_rollout_ref.rollout.response_length ({a.rollout.response_length}) must equal "
        f"data.max_response_length ({d.max_response_length})",
    )
    override = dict(a.model.override_config)
    max_pos = override.get("max_position_embeddings")
    total = d.max_prompt_length + d.max_response_length
    need(
        max_pos is None or total <= max_pos,
        f"data.max_prompt_length + data.max_response_length ({total}) exceeds "
        f"actor_rollout_ref.model.override_config.max_position_embeddings ({max_pos})",
    )
    for key in ("train_files", "val_files"):
        for path in as_file_list(d[key]):
            need(
                os.path.exists(path),
                f"data.{key}: no such file {path!r} (GSM8K: python -m hybridjax.data.gsm8k "
                "--input tests/assets/gsm8k --output data/gsm8k)",
            )
            need(
                not os.path.isdir(path),
                f"data.{key}: {path!r} is a directory; name the parquet file(s) in it",
            )
    problems += _path_problems(c)
    problems += _custom_reward_problems(c)
    algo, overlong = c.algorithm, c.reward_model.overlong_buffer
    greedy = algo.adv_estimator in ADV_ESTIMATORS and needs_reward_baseline(algo.adv_estimator)
    need(
        not greedy or dp <= 0 or bsz % dp == 0,
        f"algorithm.adv_estimator {algo.adv_estimator!r} generates one greedy response per "
        f"prompt: data.train_batch_size ({bsz}) must be divisible by the data-parallel size ({dp})",
    )
    if a.actor.recompute_old_log_prob == "false":
        reasons = off_policy_reasons(c)
        need(
            not reasons,
            "actor_rollout_ref.actor.recompute_old_log_prob is 'false', but the actor update is "
            "not on-policy, so π_old must come from a separate pass ('auto' or 'true'): "
            + "; ".join(reasons),
        )
    t = c.trainer
    need(
        t.rollout_mode == "async" or t.staleness_threshold == 1,
        f"trainer.staleness_threshold ({t.staleness_threshold}) is read only with "
        f"trainer.rollout_mode='async' (got {t.rollout_mode!r}; one_step_off lags by exactly 1)",
    )
    need(
        t.rollout_mode == "sync" or not algo.filter_groups.enable,
        f"algorithm.filter_groups.enable draws more batches within a step; with "
        f"trainer.rollout_mode={t.rollout_mode!r} batches are drawn ahead: use 'sync'",
    )
    need(
        a.model.lora_rank == 0 or a.ref.fsdp_config.model_dtype == "float32",
        f"{REF_DTYPE}={a.ref.fsdp_config.model_dtype!r}: with LoRA the reference is the "
        "actor's own base weights (adapters off); leave it 'float32'",
    )
    offloads = [
        f"{section}.fsdp_config.{key}"
        for section, node in (
            ("actor_rollout_ref.actor", a.actor),
            ("critic.model", c.critic.model),
        )
        for key in ("param_offload", "optimizer_offload")
        if node.fsdp_config[key]
    ]
    need(
        t.rollout_mode == "sync" or not offloads,
        f"{offloads} offload training states while the rollout runs on the same devices; with "
        f"trainer.rollout_mode={t.rollout_mode!r} the rollout has its own pool: set them False",
    )
    need(
        not algo.rollout_is or algo.rollout_is_threshold > 0,
        "algorithm.rollout_is is true but algorithm.rollout_is_threshold is 0 (not set)",
    )
    need(
        not overlong_enabled(c.reward_model) or 0 < overlong.len < d.max_response_length,
        f"reward_model.overlong_buffer.len ({overlong.len}) must be in "
        f"(0, data.max_response_length = {d.max_response_length}) when enabled "
        "(reward_model.reward_manager=dapo enables it)",
    )
    need(
        not c.reward_model.enable or bool(c.reward_model.model.path or c.reward_model.remote.urls),
        "reward_model.enable is true but reward_model.model.path and reward_model.remote.urls "
        "are empty",
    )
    need(
        bool(a.model.path) or bool(override),
        "actor_rollout_ref.model.path is empty and actor_rollout_ref.model.override_config "
        "is empty: give a checkpoint or the shape of a random model",
    )
    return problems


def _path_problems(c: ConfigDict) -> list[str]:
    """`trainer.default_local_dir` must be a directory (or not exist yet); `trainer.resume_mode`
    is `auto`, `disable` or an existing `.../global_step_<N>` directory."""
    t, problems = c.trainer, []
    out = t.default_local_dir
    if os.path.lexists(out) and not os.path.isdir(out):
        problems.append(f"trainer.default_local_dir: {out!r} exists and is not a directory")
    if t.resume_mode in RESUME_MODES:
        return problems
    try:
        directory, _ = split_checkpoint_path(t.resume_mode)
    except CheckpointError as err:
        return [*problems, str(err)]
    path = os.path.abspath(t.resume_mode.rstrip("/"))
    if not os.path.isdir(path):
        found = sorted(
            name
            for name in (os.listdir(directory) if os.path.isdir(directory) else [])
            if name.startswith(STEP_PREFIX + "_") and os.path.isdir(os.path.join(directory, name))
        )
        problems.append(
            f"trainer.resume_mode: no checkpoint at {path!r} (in {directory}: "
            f"{', '.join(found) or 'none'}); valid values: {RESUME_MODES} or an existing path"
        )
    return problems


def _custom_reward_problems(c: ConfigDict) -> list[str]:
    """Loads `custom_reward_function.path` and checks that `name` exists and can be called as
    verl calls it (per row, or by keyword for `reward_model.reward_manager=batch`)."""
    custom = c.custom_reward_function
    if not custom.path:
        return []
    kwargs = dict(custom.reward_kwargs)
    try:
        fn = load_custom_reward_function(custom.path, custom.name, kwargs)
    except (FileNotFoundError, AttributeError) as err:
        return [str(err)]
    except Exception as err:  # noqa: BLE001 - the user's module failed to import
        return [
            f"custom_reward_function.path: importing {custom.path!r} failed: "
            f"{type(err).__name__}: {err}"
        ]
    try:
        check_signature(
            fn, c.reward_model.reward_manager == "batch", f"{custom.path}:{custom.name}"
        )
    except TypeError as err:
        return [f"custom_reward_function.name: {err} (reward_kwargs {sorted(kwargs)})"]
    return []


def _estimator_problems(c: ConfigDict) -> list[str]:
    """Traces the configured advantage estimator abstractly with the inputs this config gives
    it (values only with a critic, greedy baselines when the estimator declares it needs them),
    so a missing input fails now, not after a rollout."""
    n = c.actor_rollout_ref.rollout.n
    rewards = jax.ShapeDtypeStruct((2 * n, 4), jnp.float32)
    baselines = jax.ShapeDtypeStruct((2 * n,), jnp.float32)
    algorithm = algorithm_config(c)

    def estimate(rewards_BxT, mask_BxT, values_BxT, baselines_B):
        return compute_advantage(
            rewards_BxT,
            mask_BxT,
            config=algorithm,
            uid_B=jnp.arange(2 * n) // n,
            values_BxT=values_BxT,
            reward_baselines_B=baselines_B,
        )

    values = rewards if c.critic.enable else None
    baselines = baselines if needs_reward_baseline(c.algorithm.adv_estimator) else None
    try:
        jax.eval_shape(estimate, rewards, rewards, values, baselines)
    except ValueError as err:
        hint = "" if c.critic.enable else " (set critic.enable=True for a critic's values)"
        return [f"algorithm.adv_estimator: {c.algorithm.adv_estimator!r}: {err}{hint}"]
    return []


def _lora_problems(c: ConfigDict) -> list[str]:
    """`{actor_rollout_ref,critic}.model.{lora_rank,lora_alpha,target_modules}` (`LoRAConfig`)."""
    problems = []
    for where in ("actor_rollout_ref.model", "critic.model"):
        try:
            LoRAConfig.from_config(_get(c, where), where)
        except ValueError as err:
            problems += str(err).split("; ")
    return problems


def _data_parallel_size(c: ConfigDict, n_devices: int) -> int:
    """Batch shards of the actor pool's training mesh (data × fsdp); 0 when it does not fit."""
    pools, problems = pool_sizes(c, n_devices)
    if problems:
        return 0
    size = pools[c.placement.actor]
    try:
        sizes = MeshConfig.from_config(pool_config(c, c.placement.actor, size)).train_sizes(size)
    except ValueError:
        return 0
    return sizes["data"] * sizes["fsdp"]


def _pool_problems(
    c: ConfigDict, n_devices: int, model_configs: Mapping[str, ModelConfig] | None
) -> list[str]:
    """Pools and placement (`hybridjax.sharding.pools`), then the mesh / batch / head-count
    checks per pool in use, each line naming the pool and its roles (one pool holding every
    device: the checks of `mesh.*` on every device, as without pools)."""
    problems = placement_problems(c, n_devices)
    if problems:
        return problems
    sizes, _ = pool_sizes(c, n_devices)
    if len(sizes) == 1:
        return parallelism_problems(c, n_devices, model_configs)
    for name, size in sizes.items():
        roles = [r for r in ROLES if c.placement[r] == name]
        if roles:
            found = parallelism_problems(pool_config(c, name, size), size, model_configs)
            problems += [
                f"resource_pool.{name} ({size} devices, roles {roles}): {p}" for p in found
            ]
    return problems


def validate(
    cfg: ConfigDict, n_devices: int, model_configs: Mapping[str, ModelConfig] | None = None
) -> None:
    """Checks `cfg` against the schema and the rules above for a run on `n_devices` devices,
    with the mesh, batch and head-count checks of `hybridjax.sharding` (`model_configs`: config
    key of each model → its ModelConfig, for the head counts).

    Raises:
      ConfigError: listing every problem, one per line, each naming its key and value.
    """
    problems = _schema_problems(cfg)
    if not problems:  # ranges and structure assume well-typed values
        for key, ok, why in _range_rules(cfg):
            value = _get(cfg, key)
            if not ok(value):
                problems.append(f"{key}: {why} (got {value!r})")
        problems += _structure_problems(cfg, n_devices) + step.config_problems(cfg)
        problems += packing_problems(cfg)
        problems += multi_turn_problems(cfg)
        problems += _pool_problems(cfg, n_devices, None)
        problems += _lora_problems(cfg)
        problems += missing_logger_packages(cfg.trainer.logger)
        if not problems:  # the estimator config is only built from a valid algorithm section
            problems += _estimator_problems(cfg)
        if not problems and model_configs:
            problems += model_problems(cfg, n_devices, model_configs)
    _raise(problems)


def validate_models(
    cfg: ConfigDict, n_devices: int, model_configs: Mapping[str, ModelConfig]
) -> None:
    """The checks that need the models' shapes, on a config `validate` accepted: attention
    heads against each pool's tensor axes, and with `trainer.check_memory` the memory plan.

    Raises:
      ConfigError: listing every problem, one per line, each naming its key and value.
    """
    _raise(model_problems(cfg, n_devices, model_configs))


def _raise(problems: list[str]) -> None:
    if problems:
        raise ConfigError(
            f"invalid config ({len(problems)} problem{'s' * (len(problems) > 1)}):\n  "
            + "\n  ".join(problems)
        )


def model_problems(
    c: ConfigDict, n_devices: int, model_configs: Mapping[str, ModelConfig]
) -> list[str]:
    """Problems of `validate_models` (see there), each naming the pool when there are several."""
    sizes, _ = pool_sizes(c, n_devices)
    if len(sizes) == 1:
        pools = {"": (c, n_devices)}
    else:
        used = {c.placement[r] for r in ROLES}
        pools = {n: (pool_config(c, n, size), size) for n, size in sizes.items() if n in used}
    problems = []
    for name, (config, size) in pools.items():
        mesh = MeshConfig.from_config(config)
        found = head_count_problems(
            mesh.train_sizes(size), mesh.generate_sizes(size), model_configs
        )
        roles = [r for r in ROLES if c.placement[r] == name]
        prefix = f"resource_pool.{name} ({size} devices, roles {roles}): " if name else ""
        problems += [prefix + p for p in found]
    if not problems and c.trainer.check_memory:  # compiles each stage
        problems += memory_problems(c, n_devices, model_configs["actor_rollout_ref.model"])
    return problems
