"""The RL run's start-up check: `hybridjax.config.checks` with the checks of the layers above
the config (the step's stages and dynamic sampling, multi-turn rollouts, the memory plan),
every problem in one `ConfigError`.

    validate(cfg, n_devices)                        # before any file is read or model built
    validate_models(cfg, n_devices, model_configs)  # once the models' config.json are read
"""

from __future__ import annotations

from collections.abc import Mapping

from ml_collections import ConfigDict

from hybridjax.config import checks
from hybridjax.memory.planner import memory_problems
from hybridjax.models.config import ModelConfig
from hybridjax.rl import multi_turn, step

CHECKS: tuple[checks.ConfigCheck, ...] = (step.config_problems, multi_turn.config_problems)


def _memory_problems(
    cfg: ConfigDict, n_devices: int, model_configs: Mapping[str, ModelConfig]
) -> list[str]:
    """`trainer.check_memory`: the memory plan of the run on `n_devices` (compiles each stage)."""
    if not cfg.trainer.check_memory:
        return []
    return memory_problems(cfg, n_devices, model_configs["actor_rollout_ref.model"])


MODEL_CHECKS: tuple[checks.ModelCheck, ...] = (_memory_problems,)


def validate(
    cfg: ConfigDict, n_devices: int, model_configs: Mapping[str, ModelConfig] | None = None
) -> None:
    """`hybridjax.config.checks.validate` with the RL run's checks (`CHECKS`, and with
    `model_configs` the memory plan).

    Raises:
      ConfigError: listing every problem, one per line, each naming its key and value.
    """
    checks.validate(cfg, n_devices, model_configs, checks=CHECKS, model_checks=MODEL_CHECKS)


def validate_models(
    cfg: ConfigDict, n_devices: int, model_configs: Mapping[str, ModelConfig]
) -> None:
    """`hybridjax.config.checks.validate_models` with the memory plan (`trainer.check_memory`).

    Raises:
      ConfigError: listing every problem, one per line, each naming its key and value.
    """
    checks.validate_models(cfg, n_devices, model_configs, MODEL_CHECKS)
