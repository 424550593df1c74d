"""Frozen, hashable algorithm configs built from verl-named config sections.

Jitted code takes these dataclasses (static or closed over), never a `ConfigDict`. Build them
once from the config file's sections::

    algo = AlgorithmConfig.from_dict(config.algorithm)      # algorithm.*
    actor = ActorLossConfig.from_dict(config.actor_rollout_ref.actor)  # actor.*
    critic = CriticLossConfig.from_dict(config.critic)      # critic.*

`from_dict` reads only the keys below and ignores the rest of the section (batch sizes, optimiser
settings, ... belong to other stages). Construction validates every name by looking it up, so a
typo fails at start-up with the list of valid names.

| key | default | meaning |
|---|---|---|
| `algorithm.adv_estimator` | `gae` | name in the advantage-estimator registry |
| `algorithm.gamma`, `algorithm.lam` | 1.0, 1.0 | discount and GAE λ |
| `algorithm.norm_adv_by_std_in_grpo` | True | False = Dr.GRPO |
| `algorithm.use_kl_in_reward`, `algorithm.kl_penalty` | False, `kl` | KL in the reward |
| `algorithm.kl_ctrl.{type,kl_coef,target_kl,horizon}` | fixed, 0.001, 0.1, 10000 | KL controller |
| `algorithm.rollout_is_threshold` | None | upper IS threshold; None = no IS weights |
| `algorithm.rollout_is` | False | apply the IS weights to the loss (else metrics only) |
| `algorithm.rollout_is_threshold_lower` | None | lower threshold (default 1/upper) |
| `algorithm.rollout_is_level`, `_mode` | token, truncate | token/sequence/geometric; or mask |
| `algorithm.rollout_is_veto_threshold` | None | reject a sequence with a token ratio below |
| `algorithm.rollout_rs` | "" | a mismatch mask by name (`icepop`, `sequence_mask`, ...) |
| `algorithm.rollout_rs_threshold`, `_lower` | None, None | its bounds (None: its defaults) |
| `actor.policy_loss.loss_mode` | `vanilla` | name in the policy-loss registry |
| `actor.clip_ratio`, `_low`, `_high` | 0.2, clip_ratio, clip_ratio | PPO clip range |
| `actor.clip_ratio_c` | 3.0 | dual-clip bound (> 1) |
| `actor.loss_agg_mode`, `actor.loss_scale_factor` | token-mean, None | see `loss_agg` |
| `actor.entropy_coeff` | 0.0 | entropy bonus weight |
| `actor.use_kl_loss`, `kl_loss_coef`, `kl_loss_type` | False, 0.001, low_var_kl | KL as a loss |
| `critic.cliprange_value`, `critic.loss_agg_mode` | 0.5, token-mean | value loss |
| `reward_model.overlong_buffer.{enable,len,penalty_factor}` | False, 0, 1.0 | DAPO shaping |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridjax.algorithms.loss_agg import check_loss_agg_mode
from hybridjax.algorithms.registry import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_REJECTIONS,
)

ROLLOUT_IS_LEVELS = ("token", "sequence", "geometric")
ROLLOUT_IS_MODES = ("truncate", "mask")
KL_CTRL_TYPES = ("fixed", "adaptive")


def _as_dict(section: Mapping[str, Any] | Any | None) -> dict[str, Any]:
    """A plain dict from a dict, a `ConfigDict` (`to_dict`) or None."""
    if section is None:
        return {}
    if hasattr(section, "to_dict"):
        return section.to_dict()
    return dict(section)


def _pick(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    names = {field.name for field in dataclasses.fields(cls)}
    return {key: value for key, value in values.items() if key in names}


def check_kl_penalty_type(kl_penalty: str) -> str:
    """Returns `kl_penalty` if it names a registered KL estimator, optionally with the
    straight-through suffix `+`; raises ValueError listing the valid names."""
    if kl_penalty.removesuffix("+") not in KL_ESTIMATORS:
        names = KL_ESTIMATORS.names()
        valid = ", ".join(names + tuple(name + "+" for name in names))
        raise ValueError(f"unknown KL estimator {kl_penalty!r}; valid: {valid}")
    return kl_penalty


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(choices)}")


@dataclasses.dataclass(frozen=True)
class KLControlConfig:
    """`algorithm.kl_ctrl`: the coefficient of the KL penalty in the reward."""

    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000

    def __post_init__(self):
        _check_choice("kl_ctrl.type", self.type, KL_CTRL_TYPES)
        if self.type == "adaptive" and self.horizon <= 0:
            raise ValueError(f"kl_ctrl.horizon must be > 0, got {self.horizon}")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """`algorithm.*`: advantage estimation, KL in the reward, rollout importance sampling."""

    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = KLControlConfig()
    rollout_is: bool = False
    rollout_is_threshold: float | None = None
    rollout_is_threshold_lower: float | None = None
    rollout_is_level: str = "token"
    rollout_is_mode: str = "truncate"
    rollout_is_veto_threshold: float | None = None
    rollout_rs: str = ""  # "" = off
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None

    def __post_init__(self):
        ADV_ESTIMATORS.get(self.adv_estimator)
        check_kl_penalty_type(self.kl_penalty)
        _check_choice("rollout_is_level", self.rollout_is_level, ROLLOUT_IS_LEVELS)
        _check_choice("rollout_is_mode", self.rollout_is_mode, ROLLOUT_IS_MODES)
        if self.rollout_is and self.rollout_is_threshold is None:
            raise ValueError("algorithm.rollout_is needs algorithm.rollout_is_threshold")
        if self.rollout_rs:
            ROLLOUT_REJECTIONS.get(self.rollout_rs)
            if self.resolved_rollout_rs_thresholds[0] is None:
                raise ValueError(
                    f"algorithm.rollout_rs={self.rollout_rs!r} needs algorithm.rollout_rs_threshold"
                )

    @property
    def resolved_rollout_rs_thresholds(self) -> tuple[float | None, float | None]:
        """(upper, lower) bounds of `rollout_rs`'s entry: the configured ones, else its own
        defaults (`hybridjax.algorithms.rollout_correction`); None: no bound."""
        fn = ROLLOUT_REJECTIONS.get(self.rollout_rs)
        upper = self.rollout_rs_threshold
        lower = self.rollout_rs_threshold_lower
        upper = fn.default_threshold if upper is None else upper
        return upper, fn.default_threshold_lower if lower is None else lower

    @property
    def rollout_rs_stage(self) -> str:
        """Where `rollout_rs` runs: "old_log_prob", "update", or "" (off)."""
        return ROLLOUT_REJECTIONS.get(self.rollout_rs).stage if self.rollout_rs else ""

    @property
    def uses_rollout_is_weights(self) -> bool:
        """Whether the policy loss reads `rollout_is_weights`: `rollout_is`, or a
        `rollout_rs` entry of the old_log_prob stage (they reweight the tokens they keep)."""
        return self.rollout_is or self.rollout_rs_stage == "old_log_prob"

    @property
    def resolved_rollout_is_threshold_lower(self) -> float | None:
        if self.rollout_is_threshold_lower is not None:
            return self.rollout_is_threshold_lower
        return None if self.rollout_is_threshold is None else 1.0 / self.rollout_is_threshold

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | Any | None) -> AlgorithmConfig:
        values = _pick(cls, _as_dict(section))
        if "kl_ctrl" in values:
            values["kl_ctrl"] = KLControlConfig(
                **_pick(KLControlConfig, _as_dict(values["kl_ctrl"]))
            )
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class ActorLossConfig:
    """`actor.*`: policy loss, its aggregation, entropy bonus and KL loss.

    `clip_ratio_low` / `clip_ratio_high` default to `clip_ratio` (resolved at construction).
    """

    loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    # None: follow clip_ratio; __post_init__ resolves both, so they read as floats
    clip_ratio_low: float = None  # type: ignore[assignment]
    clip_ratio_high: float = None  # type: ignore[assignment]
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"

    def __post_init__(self):
        if self.clip_ratio_low is None:
            object.__setattr__(self, "clip_ratio_low", self.clip_ratio)
        if self.clip_ratio_high is None:
            object.__setattr__(self, "clip_ratio_high", self.clip_ratio)
        POLICY_LOSSES.get(self.loss_mode)
        check_loss_agg_mode(self.loss_agg_mode)
        check_kl_penalty_type(self.kl_loss_type)
        if self.clip_ratio_c <= 1.0:
            raise ValueError(
                f"actor.clip_ratio_c must be > 1 (dual-clip PPO), got {self.clip_ratio_c}"
            )

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | Any | None) -> ActorLossConfig:
        """Reads verl's nested `policy_loss.loss_mode` (a plain `policy_loss` string works too)."""
        raw = _as_dict(section)
        values = _pick(cls, raw)
        policy_loss = raw.get("policy_loss")
        if isinstance(policy_loss, str):
            values["loss_mode"] = policy_loss
        elif policy_loss is not None and "loss_mode" in _as_dict(policy_loss):
            values["loss_mode"] = _as_dict(policy_loss)["loss_mode"]
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class CriticLossConfig:
    """`critic.*`: clipped value loss."""

    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None

    def __post_init__(self):
        check_loss_agg_mode(self.loss_agg_mode)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | Any | None) -> CriticLossConfig:
        return cls(**_pick(cls, _as_dict(section)))


@dataclasses.dataclass(frozen=True)
class OverlongBufferConfig:
    """`reward_model.overlong_buffer`: DAPO's soft overlong punishment (arXiv:2503.14476)."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0

    def __post_init__(self):
        if self.enable and self.len <= 0:
            raise ValueError(f"overlong_buffer.len must be > 0 when enabled, got {self.len}")

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | Any | None) -> OverlongBufferConfig:
        return cls(**_pick(cls, _as_dict(section)))
