"""The GSM8K rule reward every peer uses, plus a clock that times training steps from it.

Standalone (standard library only) so that it imports in the peers' own virtualenvs. Scores
follow the project's strict GSM8K rule (docs/verl_behaviour.md): the answer is the last
`#### <number>` in the response, compared as a number after dropping thousands separators.

The step clock: every system calls its reward function exactly once per training step (one
rollout batch per step), so the time between consecutive calls is the step time, measured the
same way for every system without touching its internals.
"""

from __future__ import annotations

import re
import time

_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def gsm8k_score(response: str, ground_truth: str) -> float:
    """1.0 if the last `#### n` in `response` equals `ground_truth` as a number, else 0.0.

    `#### 1,234` vs "1234" -> 1.0; `First #### 3 then #### 4` vs "4" -> 1.0; no `####` -> 0.0.
    """
    found = _ANSWER.findall(response)
    if not found:
        return 0.0
    try:
        return float(float(found[-1].replace(",", "")) == float(ground_truth.replace(",", "")))
    except ValueError:
        return 0.0


class StepClock:
    """Reward function wrapper that records a timestamp and the token count of each call.

    `token_counter(prompts, completions, **kwargs) -> int` returns the prompt + response tokens
    of the batch; `step_times_s()` returns the gaps between calls (seconds, host wall clock).
    """

    def __init__(self, truth_by_prompt: dict[str, str], token_counter):
        self.truth_by_prompt = truth_by_prompt
        self.token_counter = token_counter
        self.stamps: list[float] = []
        self.cpu_stamps: list[float] = []
        self.tokens: list[int] = []
        self.scores: list[float] = []
        self.__name__ = "gsm8k_strict"

    def _truth(self, prompt) -> str:
        text = prompt if isinstance(prompt, str) else str(prompt)
        for key, truth in self.truth_by_prompt.items():
            if text.endswith(key) or key.endswith(text) or key in text:
                return truth
        raise KeyError(f"prompt not in the workload: {text[:80]!r}")

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(time.process_time())
        self.tokens.append(int(self.token_counter(prompts, completions, **kwargs)))
        scores = [gsm8k_score(c, self._truth(p)) for p, c in zip(prompts, completions, strict=True)]
        self.scores.append(sum(scores) / len(scores))
        return scores

    def step_times_s(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]

    def step_cpu_times_s(self) -> list[float]:
        """CPU seconds (all threads of the process) between calls: less sensitive than wall
        time to other load on a shared machine."""
        return [b - a for a, b in zip(self.cpu_stamps, self.cpu_stamps[1:], strict=False)]
