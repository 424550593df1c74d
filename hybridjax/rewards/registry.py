"""Rule-based reward functions keyed by a row's `data_source`, and custom ones from config.

A reward function has verl's signature
`fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`; a dict carries the
score under `score` and any other keys as extra metrics. `default_compute_score` dispatches on
`data_source` (verl's name, so verl users' code ports unchanged); `register_reward` adds a source;
`load_custom_reward_function` reads `custom_reward_function.{path,name}` from config.

Built-in sources:
  * `openai/gsm8k`: GSM8K, strict (number after the last `####`);
  * `openai/gsm8k@flexible`: GSM8K, flexible (the last number of the response);
  * `arithmetic`: the quick-start arithmetic task (GSM8K's `#### n` answers, strict);
  * `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`, `math`:
    the last `\\boxed{}` against the ground truth.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from hybridjax.errors import ConfigError
from hybridjax.rewards import gsm8k, math_boxed
from hybridjax.user_code import CodeNotFound, load_module

# fn(solution_str, ground_truth, extra_info) -> float | dict
ScoreFn = Callable[[str, Any, Any], Any]
_REGISTRY: dict[str, ScoreFn] = {}


def register_reward(*data_sources: str) -> Callable[[ScoreFn], ScoreFn]:
    """Decorator: registers `fn(solution_str, ground_truth, extra_info)` for each data source.

    Raises:
      ValueError: a data source is already registered.
    """

    def decorator(fn: ScoreFn) -> ScoreFn:
        for source in data_sources:
            if source in _REGISTRY:
                raise ValueError(f"reward for data_source {source!r} is already registered")
        for source in data_sources:
            _REGISTRY[source] = fn
        return fn

    return decorator


def registered_data_sources() -> list[str]:
    """The registered `data_source` names, sorted."""
    return sorted(_REGISTRY)


def check_data_sources(sources_by_key: dict[str, set[str]], custom: bool) -> None:
    """Checks at start-up, before any model is built, that the built-in dispatch has a reward
    function for every `data_source` of the data (`sources_by_key`: config key of the files ->
    their data sources). Nothing to check with a custom function (`custom`).

    Raises:
      ConfigError: names each key with its unknown sources and lists the known ones.
    """
    if custom:
        return
    problems = [
        f"{key}: data_source {sorted(sources - set(_REGISTRY))} has no reward function"
        for key, sources in sources_by_key.items()
        if sources - set(_REGISTRY)
    ]
    if problems:
        raise ConfigError(
            "; ".join(problems) + f" (known: {registered_data_sources()}); register one "
            "(hybridjax.rewards.register_reward) or set custom_reward_function.path"
        )


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> float | dict:
    """Scores one response with the reward function registered for `data_source` (verl's name).

    Raises:
      ValueError: no reward function for `data_source` (the message lists the known ones).
    """
    fn = _REGISTRY.get(data_source)
    if fn is None:
        raise ValueError(
            f"no reward function for data_source {data_source!r}; known: "
            f"{registered_data_sources()} (or set custom_reward_function.path)"
        )
    return fn(solution_str, ground_truth, extra_info)


def load_custom_reward_function(
    path: str, name: str = "compute_score", reward_kwargs: dict | None = None
) -> Callable[..., Any]:
    """verl's `custom_reward_function`: the function `name` from the Python file `path`.

    `path` may also be a dotted module name (`mypkg.rewards`). `reward_kwargs` are bound as
    keyword arguments. The function is called as `fn(data_source, solution_str, ground_truth,
    extra_info)`.

    Raises:
      FileNotFoundError: `path` is neither a file nor an importable module.
      AttributeError: the module has no callable `name`.
    """
    try:
        module = load_module(path)
    except CodeNotFound as e:
        raise FileNotFoundError(
            f"custom_reward_function.path {path!r} is not a file or an importable module"
        ) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"custom_reward_function.name {name!r} is not a function in {path}")
    return functools.partial(fn, **reward_kwargs) if reward_kwargs else fn


@register_reward("openai/gsm8k", "arithmetic")
def gsm8k_strict(solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 if the number after the last `#### ` equals the ground truth, else 0.0."""
    return gsm8k.compute_score(solution_str, str(ground_truth), method="strict")


@register_reward("openai/gsm8k@flexible")
def gsm8k_flexible(solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 if the last number in the response equals the ground truth, else 0.0."""
    return gsm8k.compute_score(solution_str, str(ground_truth), method="flexible")


@register_reward(
    "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math"
)
def math_boxed_answer(solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 if the last `\\boxed{}` answer equals the ground truth after normalisation, else 0.0."""
    return math_boxed.compute_score(solution_str, str(ground_truth))
