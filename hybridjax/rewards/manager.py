"""The reward stage's rule-based part: score decoded responses in a thread pool.

`RewardManager.submit(...)` returns a `concurrent.futures.Future` at once, so the trainer can start
scoring right after generation and collect the result when it needs `token_level_scores` (verl's
"naive" reward manager, off the device's critical path: JAX releases the GIL while the device
runs the reference/critic passes). Each row's score goes on its last valid response token;
an empty response gets no reward anywhere (docs/verl_behaviour.md, "Rewards").

A reward function that raises, or returns NaN/inf, never poisons the run silently: it is logged,
counted (`reward/num_errors`, `reward/num_nonfinite`) and handled by `reward_model.on_error`:
`zero` scores the row 0, `raise` stops with `RewardFunctionError` naming the row.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hybridjax.rewards.registry import (
    default_compute_score,
    load_custom_reward_function,
    registered_data_sources,
)

log = logging.getLogger(__name__)
ON_ERROR_POLICIES = ("zero", "raise")
_MAX_LOGGED_ERRORS = 3  # per batch; the rest are only counted


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned a non-finite score (policy `raise`)."""


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Reward settings, from `reward_model.*` and `custom_reward_function.*` (verl's keys).

    Attributes:
      on_error: `zero` or `raise` (`reward_model.on_error`).
      num_workers: threads scoring rows (`reward_model.num_workers`).
      custom_path / custom_name / custom_kwargs: `custom_reward_function.{path,name,reward_kwargs}`;
        an empty path means the built-in `default_compute_score`.
    """

    on_error: str = "zero"
    num_workers: int = 8
    custom_path: str = ""
    custom_name: str = "compute_score"
    custom_kwargs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if self.on_error not in ON_ERROR_POLICIES:
            raise ValueError(
                f"reward_model.on_error={self.on_error!r}; expected one of {ON_ERROR_POLICIES}"
            )
        if self.num_workers < 1:
            raise ValueError(f"reward_model.num_workers={self.num_workers}; must be >= 1")

    @classmethod
    def from_config(cls, config: Any) -> RewardConfig:
        """From a trainer config (`ConfigDict` or nested dicts); missing keys keep defaults."""
        rm = _get(config, "reward_model", {}) or {}
        custom = _get(config, "custom_reward_function", {}) or {}
        kwargs = _get(custom, "reward_kwargs", {}) or {}
        return cls(
            on_error=_get(rm, "on_error", cls.on_error),
            num_workers=int(_get(rm, "num_workers", cls.num_workers)),
            custom_path=_get(custom, "path", "") or "",
            custom_name=_get(custom, "name", "") or cls.custom_name,
            custom_kwargs=tuple(sorted(dict(kwargs).items())),
        )


def _get(mapping: Any, key: str, default: Any) -> Any:
    try:
        return mapping[key] if key in mapping else default
    except TypeError:
        return default


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """Scores of one batch.

    Attributes:
      token_level_scores: B×R float32, the score at each row's last valid response token.
      scores: (B,) float32 sequence scores (0 where the function failed under `zero`).
      extra: per-row values of the extra keys returned in dicts, each (B,) (NaN where missing).
      metrics: `reward/num_errors`, `reward/num_nonfinite`, `reward/<key>/mean` per extra key.
    """

    token_level_scores: np.ndarray
    scores: np.ndarray
    extra: dict[str, np.ndarray]
    metrics: dict[str, float]


def place_scores(scores_B: np.ndarray, response_lengths_B: np.ndarray, width: int) -> np.ndarray:
    """B×width float32 with `scores[i]` at column `lengths[i] - 1`; rows of length 0 stay 0."""
    lengths = np.asarray(response_lengths_B, dtype=np.int64)
    if np.any(lengths > width) or np.any(lengths < 0):
        raise ValueError(f"response lengths must lie in [0, {width}], got {lengths.tolist()}")
    out = np.zeros((len(lengths), width), np.float32)
    rows = np.nonzero(lengths > 0)[0]
    out[rows, lengths[rows] - 1] = np.asarray(scores_B, np.float32)[rows]
    return out


def decode_responses(tokenizer, responses_BxR: np.ndarray, response_mask_BxR: np.ndarray):
    """Texts of the valid tokens of each response (special tokens skipped, as verl decodes)."""
    responses, mask = np.asarray(responses_BxR), np.asarray(response_mask_BxR).astype(bool)
    return tokenizer.batch_decode([row[m] for row, m in zip(responses, mask, strict=True)])


class RewardManager:
    """Scores batches of decoded responses with the configured reward function."""

    def __init__(self, config: RewardConfig, compute_score: Callable[..., Any] | None = None):
        self.config = config
        if compute_score is None and config.custom_path:
            compute_score = load_custom_reward_function(
                config.custom_path, config.custom_name, dict(config.custom_kwargs)
            )
        self.compute_score = compute_score or default_compute_score
        self._rows = concurrent.futures.ThreadPoolExecutor(
            config.num_workers, thread_name_prefix="reward"
        )
        self._gather = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward-gather")

    def submit(
        self,
        responses: Sequence[str],
        data_sources: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Any] | None,
        response_lengths_B: np.ndarray,
        response_width: int,
    ) -> concurrent.futures.Future[RewardResult]:
        """Starts scoring a batch; the future's result is a `RewardResult`.

        Args:
          responses: B decoded responses.
          data_sources, ground_truths, extra_infos: per-row values from the batch (B each).
          response_lengths_B: valid tokens per response (ints in [0, response_width]).
          response_width: R, the padded response length of `token_level_scores`.

        The future raises `RewardFunctionError` (policy `raise`) naming the first failing row.

        Raises:
          ValueError: the per-row lists differ in length, or (built-in dispatch) a row's
            `data_source` has no registered reward function: a configuration error, raised at
            once rather than scored 0 under `on_error=zero`.
        """
        n = len(responses)
        extra_infos = [None] * n if extra_infos is None else list(extra_infos)
        for name, values in (("data_sources", data_sources), ("ground_truths", ground_truths)):
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} rows, responses {n}")
        if self.compute_score is default_compute_score:
            unknown = sorted(set(data_sources) - set(registered_data_sources()))
            if unknown:
                raise ValueError(
                    f"no reward function for data_source {unknown}; known: "
                    f"{registered_data_sources()} (or set custom_reward_function.path)"
                )
        lengths = np.asarray(response_lengths_B)
        row_futures = [
            self._rows.submit(self._score_row, data_sources[i], responses[i], ground_truths[i],
                              extra_infos[i])
            for i in range(n)
        ]  # fmt: skip
        return self._gather.submit(
            self._collect, row_futures, list(data_sources), lengths, response_width
        )

    def __call__(self, *args, **kwargs) -> RewardResult:
        """`submit(...)` and wait for the result."""
        return self.submit(*args, **kwargs).result()

    def close(self) -> None:
        self._rows.shutdown(wait=True)
        self._gather.shutdown(wait=True)

    def _score_row(self, data_source, response, ground_truth, extra_info):
        """(score, extras, error) for one row; never raises."""
        try:
            out = self.compute_score(data_source, response, ground_truth, extra_info)
            extras = {}
            if isinstance(out, dict):
                if "score" not in out:
                    raise KeyError(f"reward dict has no 'score' key (keys: {sorted(out)})")
                extras = {k: v for k, v in out.items() if k != "score"}
                out = out["score"]
            score = float(out)
        except Exception as e:  # any failure of user code is handled by the policy
            return 0.0, {}, e
        if not math.isfinite(score):
            return 0.0, extras, FloatingPointError(f"reward function returned {score}")
        return score, extras, None

    def _collect(self, row_futures, data_sources, lengths, width) -> RewardResult:
        rows = [f.result() for f in row_futures]
        num_errors = num_nonfinite = 0
        for i, (_, _, error) in enumerate(rows):
            if error is None:
                continue
            nonfinite = isinstance(error, FloatingPointError)
            num_nonfinite += nonfinite
            num_errors += not nonfinite
            message = f"reward function failed on row {i} (data_source={data_sources[i]!r}): "
            if self.config.on_error == "raise":
                raise RewardFunctionError(message + repr(error)) from error
            if num_errors + num_nonfinite <= _MAX_LOGGED_ERRORS:
                log.warning("%s%r; scored 0 (reward_model.on_error=zero)", message, error)
        scores = np.array([s for s, _, _ in rows], np.float32)
        extra_keys = sorted({k for _, extras, _ in rows for k in extras})
        extra, metrics = (
            {},
            {
                "reward/num_errors": float(num_errors),
                "reward/num_nonfinite": float(num_nonfinite),
            },
        )
        for key in extra_keys:
            values = [extras.get(key, float("nan")) for _, extras, _ in rows]
            try:
                extra[key] = np.array(values, np.float32)
            except (TypeError, ValueError):  # non-numeric extras (e.g. the parsed answer)
                extra[key] = np.array(values, object)
                continue
            if np.any(np.isfinite(extra[key])):
                metrics[f"reward/{key}/mean"] = float(np.nanmean(extra[key]))
        return RewardResult(place_scores(scores, lengths, width), scores, extra, metrics)
