"""Start-of-run checks that the meshes, batch sizes and models fit together.

Every problem is collected and reported in ONE `ValueError`, each line naming the config keys and
their values, e.g.

    data.train_batch_size × actor_rollout_ref.rollout.n = 6 × 1 = 6 is not divisible by the
    training data-parallel size mesh.train.data × mesh.train.expert × mesh.train.fsdp
    = 1 × 1 × 4 = 4
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridjax.models.config import ModelConfig
from hybridjax.sharding.mesh import (
    GENERATE_AXES,
    TRAIN_AXES,
    MeshConfig,
    batch_shards,
    resolve_sizes,
)

# (batch-size key, which data-parallel size must divide key × rollout.n). Counted in prompts,
# as in verl; a key absent from the config is skipped.
BATCH_KEYS: tuple[tuple[str, str], ...] = (
    ("data.train_batch_size", "train"),
    ("data.train_batch_size", "generate"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", "train"),
    ("critic.ppo_mini_batch_size", "train"),
)


# mesh.train.fsdp is -1 by default: a config that sets data=-1 has two
TWO_FREE_HINT = (
    "mesh.train.fsdp=-1 is the default, parameters sharded over every device; "
    "mesh.train.data=-1 mesh.train.fsdp=1 replicates them instead"
)


def _get(config: Any, key: str) -> Any:
    """`config["a"]["b"]` for `key="a.b"`, or None when any part is missing."""
    node = config
    for part in key.split("."):
        if node is None or part not in node:
            return None
        node = node[part]
    return node


def _mesh_problems(
    mesh: MeshConfig, num_devices: int
) -> tuple[list[str], dict[str, int] | None, dict[str, int] | None]:
    problems, resolved = [], {}
    for layout, sizes, names in (
        ("train", mesh.train, TRAIN_AXES),
        ("generate", mesh.generate, GENERATE_AXES),
    ):
        try:
            resolved[layout] = dict(zip(names, resolve_sizes(sizes, num_devices), strict=True))
        except ValueError:
            given = ", ".join(f"mesh.{layout}.{a}={s}" for a, s in zip(names, sizes, strict=True))
            free = [f"mesh.{layout}.{a}" for a, s in zip(names, sizes, strict=True) if s == -1]
            if len(free) > 1:
                problems.append(
                    f"{given}: only one axis may be -1 (the rest of the devices), not "
                    f"{' and '.join(free)}; give the others a size ({TWO_FREE_HINT})"
                )
            else:
                problems.append(
                    f"{given}: must multiply to the {num_devices} devices (at most one -1)"
                )
    return problems, resolved.get("train"), resolved.get("generate")


def parallelism_problems(
    config: Any, num_devices: int, model_configs: Mapping[str, ModelConfig] | None = None
) -> list[str]:
    """Every mesh / batch / head-count problem of `config` for `num_devices` devices.

    Args:
      config: ConfigDict (or nested dict) with `mesh.train`, `mesh.generate` and verl's batch keys
        (`data.train_batch_size`, `actor_rollout_ref.rollout.n`, `...actor.ppo_mini_batch_size`,
        `critic.ppo_mini_batch_size` — the critic's only when `critic.enable` is true).
      num_devices: devices of the run (`jax.device_count()`, all processes).
      model_configs: config key of each model → its ModelConfig, e.g.
        `{"actor_rollout_ref.model": actor_cfg, "critic.model": critic_cfg}`.

    Returns:
      One line per problem, naming keys and values; empty when everything fits.
    """
    problems, train, generate = _mesh_problems(MeshConfig.from_config(config), num_devices)
    n = _get(config, "actor_rollout_ref.rollout.n") or 1
    dp = {}
    if train:
        dp["train"] = (
            batch_shards(train),
            "training data-parallel size mesh.train.data × mesh.train.expert × mesh.train.fsdp "
            f"= {train['data']} × {train['expert']} × {train['fsdp']} = {batch_shards(train)}",
        )
    if generate:
        dp["generate"] = (
            generate["data"],
            f"generation data-parallel size mesh.generate.data = {generate['data']}",
        )
    for key, layout in BATCH_KEYS:
        value = _get(config, key)
        if value is None or layout not in dp:
            continue
        if key.startswith("critic.") and not _get(config, "critic.enable"):
            continue
        size, what = dp[layout]
        if (value * n) % size:
            problems.append(
                f"{key} × actor_rollout_ref.rollout.n = {value} × {n} = {value * n} "
                f"is not divisible by the {what}"
            )
    return problems + head_count_problems(train, generate, model_configs)


def head_count_problems(
    train: Mapping[str, int] | None,
    generate: Mapping[str, int] | None,
    model_configs: Mapping[str, ModelConfig] | None,
) -> list[str]:
    """Attention heads of each model (config key → ModelConfig) that `mesh.train.tensor` or
    `mesh.generate.tensor` (axis sizes; None: not resolved) does not divide, and the
    `expert_problems` of `mesh.train.expert`."""
    problems = expert_problems(train, model_configs) if train else []
    for model_key, model in (model_configs or {}).items():
        for layout, sizes in (("train", train), ("generate", generate)):
            if not sizes:
                continue
            tensor = sizes["tensor"]
            for field in ("num_attention_heads", "num_key_value_heads"):
                heads = getattr(model, field)
                if heads % tensor:
                    problems.append(
                        f"{model_key}.{field} = {heads} is not divisible by "
                        f"mesh.{layout}.tensor = {tensor}"
                    )
    return problems


def expert_problems(
    train: Mapping[str, int], model_configs: Mapping[str, ModelConfig] | None
) -> list[str]:
    """`mesh.train.expert` > 1 (resolved training axis sizes) against the models (config key →
    ModelConfig): it must divide each MoE model's `num_experts`, and at least one model must
    be a MoE (with only dense models the axis would split nothing; a dense model beside a MoE
    one, e.g. its critic, treats the `expert` ranks as data-parallel ranks)."""
    ep = train.get("expert", 1)
    models = dict(model_configs or {})
    if ep == 1 or not models:
        return []
    moe = {k: m for k, m in models.items() if m.num_experts > 0}
    if not moe:
        return [
            f"mesh.train.expert = {ep} needs a mixture-of-experts model, but "
            f"{', '.join(models)} {'is' if len(models) == 1 else 'are'} dense (num_experts = 0);"
            " use mesh.train.expert=1"
        ]
    return [
        f"{key}.num_experts = {m.num_experts} is not divisible by mesh.train.expert = {ep}"
        for key, m in moe.items()
        if m.num_experts % ep
    ]


def check_parallelism(
    config: Any, num_devices: int, model_configs: Mapping[str, ModelConfig] | None = None
) -> None:
    """Raises ONE ValueError listing every `parallelism_problems` line; returns None if none."""
    problems = parallelism_problems(config, num_devices, model_configs)
    if problems:
        raise ValueError(
            f"invalid parallel layout for {num_devices} devices "
            f"({len(problems)} problem{'s' * (len(problems) > 1)}):\n  " + "\n  ".join(problems)
        )
