"""A generative reward model (LLM as judge): the judge *writes* a verdict, a parser reads a score.

Per row (`reward_model.generative.*`):
  1. the judge prompt is `prompt_template` filled with the decoded `{prompt}`, `{response}` and
     `{ground_truth}` (and wrapped in the judge tokenizer's chat template as one user turn when
     `apply_chat_template`), tokenized with the *judge's* tokenizer (it need not be the actor's);
  2. the judge generates at most `response_length` verdict tokens (`temperature` 0 = greedy);
  3. the verdict text goes through the parser (`parser`, a name in `VERDICT_PARSERS`, or
     `parser_path` / `parser_name`, a function `fn(verdict: str) -> float` of a user file): its
     float is the row's score. A verdict it cannot read (the parser raises ValueError) is an
     `error` outcome and follows `reward_model.on_error` like a failing rule function.

The judge generates through a `GenerateFn` (token-id prompts in, token-id verdicts out):
`EngineGenerate` runs our paged engine (`hybridjax.rollout`) with continuous batching; the
trainer builds it on the rollout's devices, `hybridjax.rewards.serve --judge_path` on its own.

Prefix sharing: a judge prompt is split at `{response}` into a prefix (template head and
prompt, the same for a prompt's n responses, whose rows are consecutive) and a continuation,
each tokenized on its own. `EngineGenerate` sends each run of equal prefixes as one request of
n samples (`hybridjax.rollout.batching.generate_after_prefixes`): the prefix's full pages are
computed once and shared, and each sample's slot computes only its own continuation.

Verl has no built-in judge: its reward loop leaves template, generation and parsing to a user
`custom_reward_function` that calls a served GenRM (docs/rewards.md, "Generative reward model").
"""

from __future__ import annotations

import dataclasses
import math
import re
import string
from collections.abc import Callable, Sequence
from typing import Any

from hybridjax.algorithms.registry import Registry
from hybridjax.rewards.scoring import Outcome
from hybridjax.user_code import load_module

# (per row: judge prompt prefix ids, continuation ids) -> per row: verdict ids. Consecutive
# rows with equal prefixes (one prompt's responses) may share the prefix's computation.
GenerateFn = Callable[[list[list[int]], list[list[int]]], list[list[int]]]
_RESPONSE_MARK = "\x00hybridjax-response\x00"
VerdictParser = Callable[[str, float, float], float]

VERDICT_PARSERS: Registry[VerdictParser] = Registry("verdict parser")  # generative.parser
TEMPLATE_FIELDS = ("prompt", "response", "ground_truth")
DEFAULT_TEMPLATE = (
    "Rate the response to the question from 0 to 1.\nQuestion: {prompt}\nResponse: {response}\n"
    "Score:"
)
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


def unknown_fields(template: str) -> list[str]:
    """The `{field}` names of a judge prompt template that are not in `TEMPLATE_FIELDS`."""
    try:  # str.format's own parser: `{{` and `}}` are literal braces
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        return [f"(malformed template: {e})"]
    return sorted({re.split(r"[.\[]", f)[0] for f in names} - set(TEMPLATE_FIELDS))


def register_parser(name: str) -> Callable[[VerdictParser], VerdictParser]:
    """Adds a verdict parser `fn(verdict, min_score, max_score) -> float` under `name`
    (`VERDICT_PARSERS.register`).

    Raises:
      ValueError: `name` is already registered.
    """
    return VERDICT_PARSERS.register(name)


def _in_range(value: float, low: float, high: float) -> float:
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"score {value} outside [{low}, {high}]")
    return value


@register_parser("number")
def parse_number(verdict: str, low: float, high: float) -> float:
    """The last number in the verdict, which must lie in [low, high] (e.g. `Score: 7`)."""
    found = re.findall(_NUMBER, verdict)
    if not found:
        raise ValueError("no number in the verdict")
    return _in_range(float(found[-1]), low, high)


@register_parser("yes_no")
def parse_yes_no(verdict: str, low: float, high: float) -> float:
    """`high` when the verdict's first word is yes, `low` when it is no (case-insensitive)."""
    words = re.findall(r"[a-z]+", verdict.lower())
    if words and words[0] in ("yes", "no"):
        return high if words[0] == "yes" else low
    raise ValueError("the verdict does not start with yes or no")


@register_parser("boxed")
def parse_boxed(verdict: str, low: float, high: float) -> float:
    """The number in the last `\\boxed{...}` of the verdict, in [low, high]."""
    found = re.findall(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}", verdict)
    if not found:
        raise ValueError("no \\boxed{number} in the verdict")
    return _in_range(float(found[-1]), low, high)


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """`reward_model.generative.*` (see the module docstring); `temperature` 0 is greedy,
    `response_length` the verdict's token bound, `seed` the sampling seed."""

    prompt_template: str = DEFAULT_TEMPLATE
    parser: str = "number"
    parser_path: str = ""
    parser_name: str = "parse_verdict"
    min_score: float = 0.0
    max_score: float = 1.0
    apply_chat_template: bool = False
    response_length: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    # release the judge engine's KV page pool after every scoring batch (rebuilt, same shape,
    # at the next one), as `rollout.free_cache_engine` does for the rollout's engine
    free_cache_engine: bool = True
    seed: int = 0

    def __post_init__(self):
        unknown = unknown_fields(self.prompt_template)
        if unknown:
            raise ValueError(
                f"reward_model.generative.prompt_template: unknown field(s) {unknown}; "
                f"valid: {list(TEMPLATE_FIELDS)}"
            )
        if not self.parser_path and self.parser not in VERDICT_PARSERS:
            raise ValueError(
                f"reward_model.generative.parser={self.parser!r}; expected one of "
                f"{list(VERDICT_PARSERS.names())} (or parser_path for a function of your own)"
            )
        if self.min_score > self.max_score:
            raise ValueError("reward_model.generative.min_score must be <= max_score")

    @classmethod
    def from_dict(cls, d: Any) -> JudgeConfig:
        """From the `reward_model.generative` block (a ConfigDict or dict)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"seed"}
        return cls(**{k: d[k] for k in names if k in d})

    def describe(self) -> str:
        """What the judge's parser is (its health and errors name it)."""
        return f"{self.parser_path}:{self.parser_name}" if self.parser_path else self.parser


def load_parser(config: JudgeConfig) -> Callable[[str], float]:
    """The configured parser as `fn(verdict) -> float`.

    Raises:
      ValueError: `parser_path` has no callable `parser_name`.
    """
    if not config.parser_path:
        fn = VERDICT_PARSERS.get(config.parser)
        return lambda v: fn(v, config.min_score, config.max_score)
    custom = getattr(load_module(config.parser_path), config.parser_name, None)
    if not callable(custom):
        raise ValueError(
            f"reward_model.generative.parser_path {config.parser_path!r} has no function "
            f"{config.parser_name!r} (reward_model.generative.parser_name)"
        )
    return lambda v: _in_range(float(custom(v)), -math.inf, math.inf)


class Judge:
    """Scores (prompt, response) texts by generating verdicts.

    Args:
      config: the template, parser and sampling settings.
      tokenizer: the judge's tokenizer (`encode`, `decode`, `apply_chat_template`).
      generate: judge prompt ids → verdict ids (`EngineGenerate`, or a stub in tests).
      max_prompt_tokens: longer judge prompts are not generated but fail their row (the
        engine's `reward_model.generative.prompt_length`); None: no limit.
    """

    def __init__(
        self,
        config: JudgeConfig,
        tokenizer: Any,
        generate: GenerateFn,
        max_prompt_tokens: int | None = None,
    ):
        self.config, self.tokenizer, self.generate = config, tokenizer, generate
        self.max_prompt_tokens = max_prompt_tokens
        self.parse = load_parser(config)

    def judge_prompt(
        self, prompt: str, response: str, ground_truth: Any = None
    ) -> tuple[list[int], list[int]]:
        """The judge's prompt for one row as (prefix ids, continuation ids): the text before
        `{response}` (template head, prompt; the same for a prompt's n responses) and the
        response with the rest, each tokenized on its own so that the prefix is shared."""
        truth = "" if ground_truth is None else str(ground_truth)
        fields = dict(prompt=prompt, response=_RESPONSE_MARK, ground_truth=truth)
        text = self.config.prompt_template.format(**fields)
        if self.config.apply_chat_template:
            message = [{"role": "user", "content": text}]
            text = str(self.tokenizer.apply_chat_template(message, tokenize=False))
        head, mark, tail = text.partition(_RESPONSE_MARK)
        prefix = self.tokenizer.encode(head)
        rest = self.tokenizer.encode(response + tail if mark else "")
        if not prefix:  # the engine wants a prefix of at least one token
            prefix, rest = rest[:1], rest[1:]
        return prefix, rest

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[Any] | None = None,
    ) -> list[Outcome]:
        """One `Outcome` per row: `ok` with the parsed score, or `error` for an unreadable
        verdict (extras `genrm_prompt_tokens`, `genrm_verdict_tokens` either way) or a judge
        prompt over `max_prompt_tokens` (not generated).
        One batched `generate` call for all rows (continuous batching inside it)."""
        truths = [None] * len(prompts) if ground_truths is None else list(ground_truths)
        parts = [self.judge_prompt(*row) for row in zip(prompts, responses, truths, strict=True)]
        limit = self.max_prompt_tokens
        fits = [limit is None or len(p) + len(c) <= limit for p, c in parts]
        judged = [pc for pc, ok in zip(parts, fits, strict=True) if ok]
        verdicts = iter(self.generate(*map(list, zip(*judged, strict=True))) if judged else [])
        outcomes = []
        for (prefix, rest), fit in zip(parts, fits, strict=True):
            if not fit:
                error = f"judge prompt of {len(prefix) + len(rest)} tokens > prompt_length {limit}"
                outcomes.append(Outcome(kind="error", error=error))
                continue
            verdict_ids = next(verdicts)
            extras = {
                "genrm_prompt_tokens": len(prefix) + len(rest),
                "genrm_verdict_tokens": len(verdict_ids),
            }
            text = self.tokenizer.decode(verdict_ids)
            try:
                outcomes.append(Outcome(score=self.parse(text), extras=extras))
            except ValueError as e:
                error = f"unparseable verdict ({self.config.describe()}: {e}): {text[:80]!r}"
                outcomes.append(Outcome(kind="error", error=error, extras=extras))
        return outcomes


def judge_metrics(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """`reward/genrm_*` of a batch: `parse_failures` (rows whose verdict was unreadable),
    `score_mean` over parsed verdicts, and the mean `prompt_tokens` / `verdict_tokens` per
    parsed row (a served judge returns no counts for failed rows, so both paths count these)."""
    ok = [o for o in outcomes if o.kind == "ok"]
    failures = sum(
        o.kind == "error" and o.error.startswith("unparseable verdict") for o in outcomes
    )
    mean = lambda values: float(sum(values) / len(values)) if values else 0.0
    return {
        "reward/genrm_parse_failures": float(failures),
        "reward/genrm_score_mean": mean([o.score for o in ok]),
        "reward/genrm_prompt_tokens": mean([o.extras.get("genrm_prompt_tokens", 0) for o in ok]),
        "reward/genrm_verdict_tokens": mean([o.extras.get("genrm_verdict_tokens", 0) for o in ok]),
    }


class EngineGenerate:
    """A `GenerateFn` on a paged `Engine`: one request per judge prompt (n = 1), continuous
    batching, at most `config.response_length` tokens each, the stop token dropped. Blocks
    (host loop; the engine is not thread-safe, so one judge batch at a time per engine).
    With `config.free_cache_engine` the engine sleeps (level 1: its KV page pool deleted, the
    weights kept) from its start and after each batch, so the stages between two reward
    stages get the pool's memory back; `released_bytes` sums what was released (over
    devices)."""

    def __init__(self, engine: Any, config: JudgeConfig, pad_token_id: int = 0):
        from hybridjax.rollout import SamplingParams

        self.engine, self.pad_token_id = engine, pad_token_id
        self.free_cache_engine, self.released_bytes = config.free_cache_engine, 0
        if self.free_cache_engine:  # no pool until the first batch (pages sized already)
            self.released_bytes += engine.sleep(1)
        self._requests = 0
        self.params = SamplingParams(
            n=1,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            max_tokens=config.response_length,
            seed=config.seed,
        )

    def __call__(self, prefixes: list[list[int]], rests: list[list[int]]) -> list[list[int]]:
        from hybridjax.rollout.batching import generate_after_prefixes

        heads: list[list[int]] = []
        groups: list[list[list[int]]] = []
        for prefix, rest in zip(prefixes, rests, strict=True):
            if not heads or heads[-1] != prefix:  # a new prompt (its rows are consecutive)
                heads.append(prefix)
                groups.append([])
            groups[-1].append(rest)
        # request indices run on across calls: a sampled verdict draws fresh noise each batch
        first, self._requests = self._requests, self._requests + len(heads)
        rows = generate_after_prefixes(self.engine, heads, groups, self.params, first)
        if self.free_cache_engine:  # the next batch's prefill wakes it (`Engine.wake_up`)
            self.released_bytes += self.engine.sleep(1)
        stops = set(self.engine.eos_ids)
        return [r[:-1] if r and r[-1] in stops else r for r in rows]


def judge_engine_config(block: Any):
    """The judge engine's `RolloutConfig` from `reward_model.generative` (`prompt_length`,
    `response_length`, `max_num_seqs`, `gpu_memory_utilization`; page size 16)."""
    from hybridjax.rollout import RolloutConfig

    # a slot holds prefix + continuation (≤ prompt_length together, `Judge`) + verdict
    return RolloutConfig(
        max_num_seqs=int(block.get("max_num_seqs", 64)),
        prompt_length=int(block.get("prompt_length", 1024)),
        response_length=int(block.get("response_length", 16)),
        gpu_memory_utilization=float(block.get("gpu_memory_utilization", 0.2)),
    )


def load_judge(path: str, config: JudgeConfig, engine_config: Any, mesh=None, dtype="float32"):
    """A `Judge` on a paged engine: the HF `*ForCausalLM` checkpoint and tokenizer at `path`,
    parameters in `dtype`, the engine on `mesh` (None: the default device).

    Raises:
      FileNotFoundError / ValueError: as `load_pretrained` and `Tokenizer.from_pretrained`.
    """
    from hybridjax.models.decoder import CausalLM
    from hybridjax.models.hf_io import load_pretrained
    from hybridjax.models.tokenizer import Tokenizer
    from hybridjax.rollout import Engine

    overrides = {"param_dtype": dtype, "dtype": dtype}
    model = load_pretrained(path, kind="causal_lm", config_overrides=overrides)
    if not isinstance(model, CausalLM):
        raise TypeError(f"reward_model.model.path {path!r}: a judge is a causal LM")
    tokenizer = Tokenizer.from_pretrained(path)
    engine = Engine(model, engine_config, mesh=mesh)
    generate = EngineGenerate(engine, config, tokenizer.pad_token_id or 0)
    return Judge(config, tokenizer, generate, engine_config.prompt_length)
