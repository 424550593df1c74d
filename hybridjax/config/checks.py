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
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from hybridjax.algorithms.advantages import (
    ADV_ESTIMATORS,
    compute_advantage,
    needs_reward_baseline,
)
from hybridjax.checkpointing.manager import STEP_PREFIX, split_checkpoint_path
from hybridjax.config import fields
from hybridjax.config.rollout_checks import eos_warnings, rollout_problems, rollout_warnings
from hybridjax.config.schema import base_config, declared_checks
from hybridjax.data.dataset import as_file_list
from hybridjax.errors import CheckpointError, ConfigError
from hybridjax.metrics.tracking import missing_logger_packages
from hybridjax.models.config import ModelConfig
from hybridjax.models.lora import LoRAConfig
from hybridjax.rewards.genrm import TEMPLATE_FIELDS, unknown_fields
from hybridjax.rewards.manager import (
    overlong_enabled,
)
from hybridjax.rewards.registry import load_custom_reward_function
from hybridjax.rewards.scoring import check_signature
from hybridjax.sharding import MeshConfig, parallelism_problems
from hybridjax.sharding.mesh import batch_shards
from hybridjax.sharding.pools import placement_problems, pool_config, pool_sizes, role_pools
from hybridjax.sharding.validate import head_count_problems
from hybridjax.training.build import (
    algorithm_config,
    dtype_of,
    off_policy_reasons,
    replay_unsupported,
)
from hybridjax.training.packing import packing_problems

log = logging.getLogger(__name__)
# the checks of the layers above this one, which they pass in (`hybridjax.rl.checks`): problems
# of the config alone, and problems of the config with its models' shapes
ConfigCheck = Callable[[ConfigDict], list[str]]
ModelCheck = Callable[[ConfigDict, int, Mapping[str, ModelConfig]], list[str]]
REF_DTYPE = "actor_rollout_ref.ref.fsdp_config.model_dtype"
RESUME_MODES = ("auto", "disable")  # or a .../global_step_<N> path
MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
FREE_FORM = (
    "override_config",
    "reward_kwargs",
    "resource_pool",
)  # dict-valued keys, checked as a whole


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


def _structure_problems(c: ConfigDict, n_devices: int) -> list[str]:
    a, d = c.actor_rollout_ref, c.data
    n = a.rollout.n
    problems = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    distill = a.distillation
    need(
        (distill.loss_mode == "forward_kl_topk") == (distill.topk > 0),
        f"actor_rollout_ref.distillation.topk={distill.topk} with loss_mode="
        f"{distill.loss_mode!r}: topk is read only by loss_mode 'forward_kl_topk', which "
        "needs it >= 1 (the teacher's tokens kept per position)",
    )
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
    if a.model.batch_invariant:
        need(
            not a.model.use_remove_padding,
            "actor_rollout_ref.model.batch_invariant scores padded batches (its attention reads "
            "keys by position), not packed ones: set actor_rollout_ref.model.use_remove_padding"
            "=False",
        )
        generate = dtype_of(a.model.dtype if a.rollout.dtype == "auto" else a.rollout.dtype)
        need(
            generate in (dtype_of(a.model.dtype), "float32"),
            f"actor_rollout_ref.model.batch_invariant needs the engine to compute with the "
            f"trainer's weights: actor_rollout_ref.rollout.dtype={a.rollout.dtype!r} rounds them "
            f"below model.dtype={a.model.dtype!r}; use 'auto'",
        )
    replay = a.actor.router_replay.mode
    need(
        replay == "disabled" or not a.model.use_remove_padding,
        f"actor_rollout_ref.actor.router_replay.mode={replay!r} replays experts in unpacked "
        "passes only: set actor_rollout_ref.model.use_remove_padding=False",
    )
    need(
        replay != "R2" or a.actor.recompute_old_log_prob != "false",
        "actor_rollout_ref.actor.router_replay.mode='R2' records the experts in the "
        "old_log_prob pass: actor_rollout_ref.actor.recompute_old_log_prob must not be 'false'",
    )
    recorded = a.rollout.enable_rollout_routing_replay
    need(
        (replay == "R3") == recorded,
        "actor_rollout_ref.actor.router_replay.mode='R3' replays the experts the rollout "
        "engine records, and only it reads them: set both it and "
        f"actor_rollout_ref.rollout.enable_rollout_routing_replay=True (now mode={replay!r}, "
        f"enable_rollout_routing_replay={recorded})",
    )
    need(
        a.rollout.log_prob_support != "replay" or not replay_unsupported(c),
        "actor_rollout_ref.rollout.log_prob_support='replay': "
        + "; ".join(replay_unsupported(c))
        + " (use 'auto' or 'full')",
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
        not t.partial_rollout or (t.rollout_mode == "async" and t.staleness_threshold >= 1),
        f"trainer.partial_rollout needs trainer.rollout_mode='async' (got {t.rollout_mode!r}) "
        f"and trainer.staleness_threshold >= 1 (got {t.staleness_threshold}): carried tokens "
        "lag one version more than fresh ones",
    )
    need(
        t.partial_rollout or t.partial_rollout_kv == "recompute",
        f"trainer.partial_rollout_kv ({t.partial_rollout_kv!r}) is read only with "
        "trainer.partial_rollout=True",
    )
    need(
        not t.partial_rollout or not a.rollout.multi_turn.enable,
        "trainer.partial_rollout carries single-turn generations over; "
        "actor_rollout_ref.rollout.multi_turn.enable must be False",
    )
    need(
        not t.partial_rollout or not needs_reward_baseline(algo.adv_estimator),
        f"trainer.partial_rollout: algorithm.adv_estimator={algo.adv_estimator!r} needs a "
        "greedy baseline generated with the batch; use another estimator or unset it",
    )
    need(
        t.rollout_mode == "sync" or not algo.filter_groups.enable,
        f"algorithm.filter_groups.enable draws more batches within a step; with "
        f"trainer.rollout_mode={t.rollout_mode!r} batches are drawn ahead: use 'sync'",
    )
    need(
        a.model.enable_gradient_checkpointing or a.model.remat_policy == "full",
        f"actor_rollout_ref.model.remat_policy={a.model.remat_policy!r} is read only with "
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    )
    need(
        a.model.lora_rank == 0 or dtype_of(a.ref.fsdp_config.model_dtype) == "float32",
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
    gen = c.reward_model.generative
    need(
        not gen.enable or c.reward_model.enable,
        "reward_model.generative.enable is true but reward_model.enable is false",
    )
    need(
        not gen.enable or gen.min_score <= gen.max_score,
        f"reward_model.generative.min_score ({gen.min_score}) > max_score ({gen.max_score})",
    )
    unknown = unknown_fields(gen.prompt_template)
    need(
        not (gen.enable and unknown),
        f"reward_model.generative.prompt_template: unknown field(s) {unknown}; valid: "
        f"{list(TEMPLATE_FIELDS)}",
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
    baseline = jax.ShapeDtypeStruct((2 * n,), jnp.float32)
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
    baselines = baseline if needs_reward_baseline(c.algorithm.adv_estimator) else None
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
    """Batch shards of the actor pool's training mesh (data × expert × fsdp); 0 when it does
    not fit."""
    pools, problems = pool_sizes(c, n_devices)
    if problems:
        return 0
    size = pools[c.placement.actor]
    try:
        sizes = MeshConfig.from_config(pool_config(c, c.placement.actor, size)).train_sizes(size)
    except ValueError:
        return 0
    return batch_shards(sizes)


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
        roles = [r for r, pool in role_pools(c).items() if pool == name]
        if roles:
            found = parallelism_problems(pool_config(c, name, size), size, model_configs)
            problems += [
                f"resource_pool.{name} ({size} devices, roles {roles}): {p}" for p in found
            ]
    return problems


def validate(
    cfg: ConfigDict,
    n_devices: int,
    model_configs: Mapping[str, ModelConfig] | None = None,
    *,
    checks: Sequence[ConfigCheck] = (),
    model_checks: Sequence[ModelCheck] = (),
) -> None:
    """Checks `cfg` against the schema and the rules above for a run on `n_devices` devices,
    with the mesh, batch and head-count checks of `hybridjax.sharding` (`model_configs`: config
    key of each model → its ModelConfig, for the head counts). `checks` and `model_checks` are
    the checks of the layers above this one (the RL run's: `hybridjax.rl.checks.validate`), run
    beside the structure checks and after the model checks.

    Warns (one line each, `rollout_checks.rollout_warnings`) of sampling that leaves nothing to
    learn from.

    Raises:
      ConfigError: listing every problem, one per line, each naming its key and value.
    """
    problems = _schema_problems(cfg)
    if not problems:  # ranges and structure assume well-typed values
        problems += fields.problems(declared_checks(), lambda key: _get(cfg, key))
        problems += _structure_problems(cfg, n_devices)
        for check in checks:
            problems += check(cfg)
        problems += packing_problems(cfg)
        problems += _pool_problems(cfg, n_devices, None)
        problems += _lora_problems(cfg)
        problems += rollout_problems(cfg)
        problems += missing_logger_packages(cfg.trainer.logger)
        if not problems:  # the estimator config is only built from a valid algorithm section
            problems += _estimator_problems(cfg)
        if not problems and model_configs:
            problems += model_problems(cfg, n_devices, model_configs, model_checks)
    _raise(problems)
    for warning in rollout_warnings(cfg):
        log.warning(warning)


def validate_models(
    cfg: ConfigDict,
    n_devices: int,
    model_configs: Mapping[str, ModelConfig],
    model_checks: Sequence[ModelCheck] = (),
) -> None:
    """The checks that need the models' shapes, on a config `validate` accepted: attention
    heads against each pool's tensor axes, then `model_checks` (the RL run's memory plan).
    Warns (one line) when the actor's eos_token_id is outside its vocabulary.

    Raises:
      ConfigError: listing every problem, one per line, each naming its key and value.
    """
    _raise(model_problems(cfg, n_devices, model_configs, model_checks))
    for warning in eos_warnings(cfg, model_configs):
        log.warning(warning)


def _raise(problems: list[str]) -> None:
    if problems:
        raise ConfigError(
            f"invalid config ({len(problems)} problem{'s' * (len(problems) > 1)}):\n  "
            + "\n  ".join(problems)
        )


def model_problems(
    c: ConfigDict,
    n_devices: int,
    model_configs: Mapping[str, ModelConfig],
    model_checks: Sequence[ModelCheck] = (),
) -> list[str]:
    """Problems of `validate_models` (see there), each naming the pool when there are several;
    also `router_replay.mode` "R3" with a dense actor. `model_checks` run only when the rest
    found nothing (the memory plan compiles each stage)."""
    sizes, _ = pool_sizes(c, n_devices)
    if len(sizes) == 1:
        pools = {"": (c, n_devices)}
    else:
        used = set(role_pools(c).values())
        pools = {n: (pool_config(c, n, size), size) for n, size in sizes.items() if n in used}
    problems = []
    for name, (config, size) in pools.items():
        mesh = MeshConfig.from_config(config)
        found = head_count_problems(
            mesh.train_sizes(size), mesh.generate_sizes(size), model_configs
        )
        roles = [r for r, pool in role_pools(c).items() if pool == name]
        prefix = f"resource_pool.{name} ({size} devices, roles {roles}): " if name else ""
        problems += [prefix + p for p in found]
    actor = model_configs.get("actor_rollout_ref.model")
    if c.actor_rollout_ref.actor.router_replay.mode == "R3" and actor and not actor.num_experts:
        problems.append(
            "actor_rollout_ref.actor.router_replay.mode='R3' replays the experts of a "
            "mixture-of-experts actor, but actor_rollout_ref.model is dense (num_experts = 0): "
            "use router_replay.mode='disabled'"
        )
    for check in model_checks:
        if problems:
            break
        problems += check(c, n_devices, model_configs)
    return problems
