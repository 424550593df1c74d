"""The reward stage's rule-based part: verl's reward managers over isolated reward functions.

`RewardManager.submit(...)` returns a `concurrent.futures.Future` at once, so the trainer can start
scoring right after generation and collect the result when it needs `token_level_scores` (off
the device's critical path: JAX releases the GIL while the device runs the reference/critic
passes). Each row's score goes on its last valid response token; an empty response gets no
reward anywhere (docs/verl_behaviour.md, "Rewards").

`reward_model.reward_manager` (verl's names):
  * `naive`: one call per row, `fn(data_source, solution_str, ground_truth, extra_info)`;
  * `batch`: one call for the whole batch, `fn(data_sources=, solution_strs=, ground_truths=,
    extra_infos=, **reward_kwargs) -> list` (verl's `BatchRewardManager`; needs a custom function);
  * `dapo`: per row as `naive`, plus DAPO's overlong shaping (`reward_model.overlong_buffer`,
    applied in the `adv` stage; `dapo` turns it on);
  * `prime`: per row in worker processes with timeouts, built-ins included (verl's
    `PrimeRewardManager`).
Where the function runs (`hybridjax.rewards.scoring`): a custom function
(`custom_reward_function.path`) in worker processes with a per-call timeout
`reward_model.timeout_s`; the built-in functions (pure Python, no I/O) and a callable passed to
the constructor in threads; with `reward_model.remote.urls`, on reward servers.

A reward function that raises, calls `sys.exit`, crashes its process, hangs past the timeout or
returns NaN/inf never ends the run: the row is counted (`reward/num_errors`,
`reward/num_timeouts`, `reward/num_nonfinite`) and handled by `reward_model.on_error`: `zero`
scores it 0, `raise` stops with `RewardFunctionError` naming the row. A function that fails on
every row of the first batch stops the run with its first error whatever the policy (a wrong
signature or a missing dependency, not a reason to train on zeros); later, steps in which most
rows failed are never checkpointed, and `reward_model.max_consecutive_failed_steps` of them in
a row stop the run (`hybridjax.rewards.guard`). A function that returns something other than
a number or a dict with a numeric `score`, or a score that is NaN/inf in float32 or beyond
±1e6, fails its row (`hybridjax.rewards.scoring.normalize`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hybridjax.errors import UserError
from hybridjax.rewards.registry import default_compute_score, registered_data_sources
from hybridjax.rewards.remote import RemoteClient, RemoteConfig
from hybridjax.rewards.scoring import FunctionSpec, Outcome, RowScorer, check_signature

log = logging.getLogger(__name__)
ON_ERROR_POLICIES = ("zero", "raise")
REWARD_MANAGERS = ("naive", "batch", "dapo", "prime")
COMBINE = ("replace", "sum")
_MAX_LOGGED_ERRORS = 3  # per batch; the rest are only counted


class RewardFunctionError(UserError, RuntimeError):
    """A reward function failed on a row (policy `raise`) or on every row of the first batch
    (a user error: the command line reports it in one line, naming the row)."""


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Reward settings, from `reward_model.*` and `custom_reward_function.*` (verl's keys).

    Attributes:
      on_error: `zero` or `raise` (`reward_model.on_error`).
      num_workers: threads or worker processes scoring rows (`reward_model.num_workers`).
      reward_manager: one of `REWARD_MANAGERS` (`reward_model.reward_manager`).
      timeout_s: seconds per call of a function in a worker process (`reward_model.timeout_s`;
        0 = no limit).
      combine: rule score and reward-model score: `replace` (the model's only, verl's) or `sum`
        (`reward_model.combine`).
      remote: `reward_model.remote.*` (reward servers).
      custom_path / custom_name / custom_kwargs: `custom_reward_function.{path,name,reward_kwargs}`;
        an empty path means the built-in `default_compute_score`.
    """

    on_error: str = "zero"
    num_workers: int = 8
    reward_manager: str = "naive"
    timeout_s: float = 30.0
    combine: str = "replace"
    remote: RemoteConfig = RemoteConfig()
    custom_path: str = ""
    custom_name: str = "compute_score"
    custom_kwargs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        for key, valid in (
            ("on_error", ON_ERROR_POLICIES),
            ("reward_manager", REWARD_MANAGERS),
            ("combine", COMBINE),
        ):
            if getattr(self, key) not in valid:
                raise ValueError(
                    f"reward_model.{key}={getattr(self, key)!r}; expected one of {valid}"
                )
        if self.num_workers < 1:
            raise ValueError(f"reward_model.num_workers={self.num_workers}; must be >= 1")
        if self.timeout_s < 0:
            raise ValueError(f"reward_model.timeout_s={self.timeout_s}; must be >= 0")
        if self.remote.urls and self.custom_path:
            raise ValueError(
                "custom_reward_function.path and reward_model.remote.urls are both set: the "
                "servers score with their own function (python -m hybridjax.rewards.serve "
                "--custom_path ...); set one"
            )
        if self.remote.urls and self.reward_manager in ("batch", "prime"):
            raise ValueError(
                f"reward_model.reward_manager={self.reward_manager!r} with remote.urls: the "
                "servers choose it (serve --reward_manager); use naive or dapo here"
            )

    @property
    def uses_builtin(self) -> bool:
        """Whether rows are scored here by the built-in dispatch on `data_source` (no custom
        function, no rule servers)."""
        return not (self.custom_path or self.remote.urls)

    @property
    def function_spec(self) -> FunctionSpec:
        return FunctionSpec(self.custom_path, self.custom_name, self.custom_kwargs)

    @classmethod
    def from_config(cls, config: Any) -> RewardConfig:
        """From a trainer config (`ConfigDict` or nested dicts); missing keys keep defaults."""
        rm = _get(config, "reward_model", {}) or {}
        custom = _get(config, "custom_reward_function", {}) or {}
        kwargs = _get(custom, "reward_kwargs", {}) or {}
        remote = _get(rm, "remote", {}) or {}
        return cls(
            on_error=_get(rm, "on_error", cls.on_error),
            num_workers=int(_get(rm, "num_workers", cls.num_workers)),
            reward_manager=_get(rm, "reward_manager", cls.reward_manager),
            timeout_s=float(_get(rm, "timeout_s", cls.timeout_s)),
            combine=_get(rm, "combine", cls.combine),
            remote=RemoteConfig() if serves_model(rm) else RemoteConfig.from_dict(remote),
            custom_path=_get(custom, "path", "") or "",
            custom_name=_get(custom, "name", "") or cls.custom_name,
            custom_kwargs=tuple(sorted(dict(kwargs).items())),
        )


def overlong_enabled(rm: Any) -> bool:
    """Whether DAPO's overlong shaping applies: `reward_model.overlong_buffer.enable`, or
    `reward_model.reward_manager=dapo` (verl applies it in its DAPO reward manager)."""
    buffer = _get(rm, "overlong_buffer", {}) or {}
    return bool(_get(buffer, "enable", False)) or _get(rm, "reward_manager", "") == "dapo"


def serves_model(rm: Any) -> bool:
    """Whether `reward_model.remote.urls` serve the reward model (`enable` with no local
    `model.path`) rather than the rule function."""
    remote, model = _get(rm, "remote", {}) or {}, _get(rm, "model", {}) or {}
    return bool(
        _get(rm, "enable", False) and _get(remote, "urls", "") and not _get(model, "path", "")
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
      metrics: `reward/num_errors`, `reward/num_timeouts`, `reward/num_nonfinite`,
        `reward/<key>/mean` per numeric extra key; with servers `reward/remote_latency_ms`
        and `reward/num_retries`.
      first_error: the first failing row's error ("" when none failed).
    """

    token_level_scores: np.ndarray
    scores: np.ndarray
    extra: dict[str, np.ndarray]
    metrics: dict[str, float]
    first_error: str = ""  # what the first failing row's function or server said


def concat_results(results: Sequence[RewardResult]) -> RewardResult:
    """The results of consecutive row blocks as one (per-process shares, in process order).

    Counts (`reward/num_*`) add up and `reward/<key>/mean` is recomputed over every row, so
    those equal the metrics of scoring all rows at once; other scalars (latencies) are averaged.
    A single result is returned as it is.
    """
    if len(results) == 1:
        return results[0]
    keys = sorted({k for r in results for k in r.extra})
    extra = {}
    for key in keys:
        parts = [r.extra.get(key, np.full(len(r.scores), np.nan, np.float32)) for r in results]
        extra[key] = np.concatenate(parts)
    names = {name for r in results for name in r.metrics}
    metrics = {  # counts add up; other scalars (e.g. latencies) are averaged over the parts
        name: float(sum(r.metrics.get(name, 0.0) for r in results))
        if name.startswith("reward/num_")
        else float(np.mean([r.metrics[name] for r in results if name in r.metrics]))
        for name in sorted(names)
        if not name.endswith("/mean")
    }
    for key, values in extra.items():
        if values.dtype != object and np.any(np.isfinite(values)):
            metrics[f"reward/{key}/mean"] = float(np.nanmean(values))
    return RewardResult(
        np.concatenate([r.token_level_scores for r in results]),
        np.concatenate([r.scores for r in results]),
        extra,
        metrics,
        next((r.first_error for r in results if r.first_error), ""),
    )


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
    """Scores batches of decoded responses with the configured reward function.

    Args:
      config: a `RewardConfig`.
      compute_score: a per-row (or, for `batch`, whole-batch) function to use instead of the
        configured one; it runs in threads of this process (no timeout: a thread cannot be
        stopped), so code that may hang belongs in `custom_reward_function.path`.

    Raises:
      FileNotFoundError, AttributeError: `custom_reward_function.{path,name}` cannot be loaded.
      TypeError: the function cannot take verl's arguments (its signature is shown).
      ValueError: `batch` without a custom function.
      RewardServerError: a reward server fails its health check.
    """

    def __init__(self, config: RewardConfig, compute_score: Callable[..., Any] | None = None):
        self.config = config
        self.remote = self.scorer = None
        self.builtin = False
        if config.remote.urls:
            self.remote = RemoteClient(config.remote, "rule")
        else:
            self.scorer, self.builtin = build_scorer(config, compute_score)
        self._gather = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward-gather")
        self._batches_done = 0

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

        The future raises `RewardFunctionError` (policy `raise`, or every row of the first
        batch failed) naming the first failing row, and `RewardServerError` when a server
        refuses a request (4xx).

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
        if self.builtin:
            unknown = sorted(set(data_sources) - set(registered_data_sources()))
            if unknown:
                raise ValueError(
                    f"no reward function for data_source {unknown}; known: "
                    f"{registered_data_sources()} (or set custom_reward_function.path)"
                )
        rows = list(zip(data_sources, responses, ground_truths, extra_infos, strict=True))
        lengths = np.asarray(response_lengths_B)
        return self._gather.submit(self._score, rows, lengths, response_width)

    def __call__(self, *args, **kwargs) -> RewardResult:
        """`submit(...)` and wait for the result."""
        return self.submit(*args, **kwargs).result()

    def close(self) -> None:
        """Stops scoring at once (hanging calls are killed, not waited for)."""
        self._gather.shutdown(wait=False, cancel_futures=True)
        for backend in (self.scorer, self.remote):
            if backend is not None:
                backend.close()

    def _score(self, rows, lengths, width) -> RewardResult:
        if self.remote is not None:
            self.remote.reset_counters()
            outcomes = self.remote.score_rows(rows)
        else:
            assert self.scorer is not None  # set whenever there is no remote
            outcomes = self.scorer.score(rows)
        first = self._batches_done == 0
        metrics = check_outcomes(outcomes, [r[0] for r in rows], self.config.on_error, first)
        if self.remote is not None:
            metrics |= self.remote.metrics()
        self._batches_done += 1
        scores = np.array([o.score for o in outcomes], np.float32)
        extra = {}
        for key in sorted({k for o in outcomes for k in o.extras}):
            values = [o.extras.get(key, float("nan")) for o in outcomes]
            try:
                extra[key] = np.array(values, np.float32)
            except (TypeError, ValueError):  # non-numeric extras (e.g. the parsed answer)
                extra[key] = np.array(values, object)
                continue
            if np.any(np.isfinite(extra[key])):
                metrics[f"reward/{key}/mean"] = float(np.nanmean(extra[key]))
        error = next((f"{o.kind}: {o.error}" for o in outcomes if o.kind != "ok"), "")
        return RewardResult(place_scores(scores, lengths, width), scores, extra, metrics, error)


def build_scorer(
    config: RewardConfig, compute_score: Callable[..., Any] | None = None
) -> tuple[RowScorer, bool]:
    """The `RowScorer` of a config (see the module docstring for where functions run), and
    whether it runs the built-in dispatch (`default_compute_score`).

    Raises:
      FileNotFoundError, AttributeError: the custom function cannot be loaded.
      TypeError: its signature does not take verl's arguments.
      ValueError: `batch` without a custom function.
    """
    batched = config.reward_manager == "batch"
    fn = compute_score or config.function_spec.load()  # here too, so that errors show at once
    builtin = fn is default_compute_score
    if batched and builtin:
        raise ValueError(
            "reward_model.reward_manager=batch calls one function with the whole batch: "
            "set custom_reward_function.path/name to such a function"
        )
    check_signature(fn, batched, repr(config.custom_name) if compute_score is None else repr(fn))
    in_threads = compute_score is not None or (builtin and config.reward_manager != "prime")
    scorer = RowScorer(
        fn if in_threads else None,
        config.function_spec,
        config.num_workers,
        config.timeout_s,
        batched,
    )
    return scorer, builtin


def check_outcomes(
    outcomes: Sequence[Outcome], data_sources: Sequence[str], on_error: str, first_batch: bool
) -> dict[str, float]:
    """Applies `reward_model.on_error` and the first-batch rule to a batch's outcomes; returns
    `reward/num_errors` (raised, exited, crashed, or a server error), `reward/num_timeouts`,
    `reward/num_nonfinite`.

    Raises:
      RewardFunctionError: every row failed and `first_batch`, or a row failed under `raise`.
    """
    failed = [i for i, o in enumerate(outcomes) if o.kind != "ok"]
    describe = lambda i: (
        f"reward function failed on row {i} (data_source={data_sources[i]!r}): "
        f"{outcomes[i].kind}: {outcomes[i].error}"
    )
    if failed and first_batch and len(failed) == len(outcomes):
        raise RewardFunctionError(
            f"every row of the first batch failed ({len(failed)} rows); the first: "
            f"{describe(failed[0])}"
        )
    if failed and on_error == "raise":
        raise RewardFunctionError(describe(failed[0]))
    for i in failed[:_MAX_LOGGED_ERRORS]:
        log.warning("%s; scored 0 (reward_model.on_error=zero)", describe(i))
    kinds = [o.kind for o in outcomes]
    return {
        "reward/num_errors": float(kinds.count("error") + kinds.count("crash")),
        "reward/num_timeouts": float(kinds.count("timeout")),
        "reward/num_nonfinite": float(kinds.count("nonfinite")),
    }
