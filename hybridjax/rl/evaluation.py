"""Validation: generate `rollout.val_kwargs.n` responses per validation prompt (with its
temperature, top-k, top-p), score them with the reward function, and report verl's metrics
(`hybridjax.metrics.validation`): `val-core/<data_source>/acc/{mean@N, best@N/*, maj@N/*}` and
`val-aux/...`. Rows that only pad the last batch are left out.

Variables: `acc` is the reward function's `acc` when it returns a dict with one, else the score
itself (the built-in rules score 0/1); `reward` is the score when it differs from `acc`; every
other numeric key of a returned dict is a variable of its own. Votes for `maj@N` are the
function's `pred` when it returns one (verl's convention); otherwise, when the built-in reward
dispatch scores in this process (`RewardManager.builtin`) and every data source has an entry in
`ANSWER_EXTRACTORS`, the answer that source's rule reads (normalised, so `1,234` and `1234.0`
are one vote; no answer is a vote of its own, as verl counts `None`). Without votes there are
no `maj@` metrics, as in verl.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from hybridjax.data.dataset import PromptLoader
from hybridjax.metrics.validation import process_validation_metrics, validation_metric_dict
from hybridjax.models.tokenizer import Tokenizer
from hybridjax.rewards import RewardManager, decode_responses, gsm8k, math_boxed
from hybridjax.rl.generation import HostColumns, generate_batch
from hybridjax.rl.multi_turn import MultiTurn
from hybridjax.rl.reward import collect_rewards, submit_rewards
from hybridjax.rollout import Engine, SamplingParams
from hybridjax.sharding.hosts import allgather

GENERATION_SEED = 42  # verl's fixed shuffle of the logged validation samples


def _gsm8k_answer(method: str) -> Callable[[str], Hashable]:
    def extract(text: str) -> Hashable:
        answer = gsm8k.extract_solution(text, method)
        number = None if answer is None else gsm8k.parse_number(answer)
        return answer if number is None else format(number.normalize(), "f")

    return extract


def _boxed_answer(text: str) -> Hashable:
    boxed = math_boxed.last_boxed_only_string(text)
    return None if boxed is None else math_boxed.strip_string(math_boxed.remove_boxed(boxed))


# The answer the built-in rule of each data source reads (hybridjax.rewards.registry).
ANSWER_EXTRACTORS: dict[str, Callable[[str], Hashable]] = {
    "openai/gsm8k": _gsm8k_answer("strict"),
    "arithmetic": _gsm8k_answer("strict"),
    "openai/gsm8k@flexible": _gsm8k_answer("flexible"),
    **dict.fromkeys(
        ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math"),
        _boxed_answer,
    ),
}


def select_generations(
    samples: list[tuple[str, str, float]], k: int, seed: int = GENERATION_SEED
) -> list[tuple[str, str, float]]:
    """verl's `_maybe_log_val_generations` choice: sort (prompt, response, score) by prompt,
    shuffle with `RandomState(seed)`, keep the first k; the same prompts every validation."""
    if k <= 0:
        return []
    chosen = sorted(samples, key=lambda s: s[0])
    np.random.RandomState(seed).shuffle(chosen)
    return chosen[:k]


def prompt_texts(tokenizer: Tokenizer, input_ids: np.ndarray, attention_mask: np.ndarray):
    """The decoded prompts (padding dropped, special tokens skipped, as verl decodes them)."""
    return decode_responses(tokenizer, input_ids, attention_mask)


def generation_samples(
    tokenizer: Tokenizer,
    prompts: dict[str, Any],
    host: HostColumns,
    scores: np.ndarray,
    k: int,
) -> list[tuple[str, str, float]]:
    """K (prompt, response, score) of one generated batch (`trainer.log_train_generations`),
    chosen as `select_generations` does; rows that only pad a batch are left out."""
    questions = prompt_texts(tokenizer, prompts["input_ids"], prompts["attention_mask"])
    questions = [q for part in allgather(questions) for q in part]  # every process's prompts
    n = len(host.row_mask) // len(questions)
    responses = decode_responses(tokenizer, host.responses, host.valid_mask)
    samples = [
        (questions[i // n], responses[i], float(scores[i])) for i in np.flatnonzero(host.row_mask)
    ]
    return select_generations(samples, k)


def validate(
    engine: Engine,
    loader: PromptLoader,
    sampling: SamplingParams,
    tokenizer: Tokenizer,
    rewards: RewardManager,
    sharding,
    log_generations: int = 0,
    first_index: int = 0,
    multi_turn: MultiTurn | None = None,
) -> dict[str, Any]:
    """Scores one pass over the validation loader.

    Args:
      sampling: `rollout.val_kwargs` (n responses per prompt).
      multi_turn: tools of multi-turn rollouts (None: single-turn).
      log_generations: K > 0 adds `val/generations`, K (prompt, response, score) tuples
        (`trainer.log_val_generations`).
      first_index: where this process's share of each batch starts (`jax.distributed`: each
        process generates and scores its share; the rows are gathered).
    Returns:
      the `val-core/*` and `val-aux/*` floats (empty without validation rows), and
      `val/generations` when asked for.
    Host sync per batch (rollout, scoring).
    """
    sources: list[str] = []
    uids: list[int] = []
    texts: list[str] = []
    scores: list[float] = []
    extras: list[dict[str, Any]] = []
    samples: list[tuple[str, str, float]] = []
    for prompts in loader.iter_epoch():
        _, host = generate_batch(
            engine, prompts, sampling, tokenizer.pad_token_id, sharding, first_index, multi_turn
        )
        responses = decode_responses(tokenizer, host.responses, host.valid_mask)
        result = collect_rewards(submit_rewards(rewards, tokenizer, host))
        if log_generations:
            questions = prompt_texts(tokenizer, prompts["input_ids"], prompts["attention_mask"])
            questions = np.repeat(
                np.concatenate(allgather(np.asarray(questions, object))), sampling.n
            )
        uid_of_row = np.repeat(np.concatenate(allgather(np.asarray(prompts["index"]))), sampling.n)
        for i in np.flatnonzero(host.row_mask):
            sources.append(host.data_source[i])
            uids.append(int(uid_of_row[i]))
            texts.append(responses[i])
            scores.append(float(result.scores[i]))
            extras.append({k: v[i] for k, v in result.extra.items()})
            if log_generations:
                samples.append((str(questions[i]), responses[i], scores[-1]))
    if not scores:
        return {}
    variables, votes = _variables(scores, extras, sources, texts, rewards)
    metrics: dict[str, Any] = validation_metric_dict(
        process_validation_metrics(sources, uids, variables, votes)
    )
    if log_generations:
        metrics["val/generations"] = select_generations(samples, log_generations)
    return metrics


def _variables(scores, extras, sources, texts, rewards: RewardManager):
    """(variables, votes) for `process_validation_metrics`, per the module docstring."""
    keys = sorted({k for row in extras for k in row})
    columns = {k: [row.get(k, np.nan) for row in extras] for k in keys}
    variables: dict[str, list] = collections.OrderedDict()
    variables["acc"] = columns.pop("acc", scores)
    if "acc" in keys:
        variables["reward"] = scores
    votes = columns.pop("pred", None)
    for key, column in columns.items():
        if all(isinstance(v, int | float | np.number) for v in column):
            variables[key] = column
    if votes is None and rewards.builtin and set(sources) <= set(ANSWER_EXTRACTORS):
        votes = [ANSWER_EXTRACTORS[s](t) for s, t in zip(sources, texts, strict=True)]
    return variables, votes
