"""Multi-turn rollouts with tools in the `gen` stage (`actor_rollout_ref.rollout.multi_turn`).

`MultiTurn.from_config` builds the tools of `multi_turn.tool_config_path` (verl's tool config
file), the chat rendering of their responses and the limits; `generate` runs
`hybridjax.rollout.agent_loop.generate_multi_turn` with them. The trainer's batch then holds
whole trajectories: attention over every token, `response_mask` 1 on model tokens only, and
each row's `extra_info` gains the trajectory for the reward function:

    extra_info["num_turns"]: assistant turns
    extra_info["messages"]: [{"role": "assistant" | "tool", "content": text}, ...]
    extra_info["tool_calls"]: [{"name", "arguments", "response", "error"}, ...]
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import yaml

from hybridjax.models.tokenizer import Tokenizer
from hybridjax.rollout import Engine, SamplingParams
from hybridjax.rollout.agent_loop import MultiTurnOutput, generate_multi_turn
from hybridjax.tools import ParseError, ToolExecutor, load_tools
from hybridjax.tools.chat import ChatTools
from hybridjax.tools.executor import TRUNCATE_SIDES
from hybridjax.tools.parser import PARSERS

KEY = "actor_rollout_ref.rollout.multi_turn"


@dataclasses.dataclass
class MultiTurn:
    """The tools and limits of multi-turn rollouts (built once per run)."""

    tools: ChatTools
    max_assistant_turns: int
    max_parallel_calls: int
    tool_threads: int

    @classmethod
    def from_config(cls, multi_turn: Any, tokenizer: Tokenizer) -> MultiTurn | None:
        """From `actor_rollout_ref.rollout.multi_turn`; None unless `enable`. Raises ValueError
        for a missing tool config or a tokenizer without a chat template."""
        if not multi_turn.enable:
            return None
        if not multi_turn.tool_config_path:
            raise ValueError("rollout.multi_turn.enable needs rollout.multi_turn.tool_config_path")
        if not tokenizer.chat_template:
            raise ValueError("rollout.multi_turn needs a tokenizer with a chat template")
        for key in ("max_assistant_turns", "max_parallel_calls", "max_tool_response_length"):
            if int(multi_turn[key]) < 1:
                raise ValueError(f"rollout.multi_turn.{key} must be >= 1, got {multi_turn[key]}")
        executor = ToolExecutor(
            load_tools(multi_turn.tool_config_path),
            timeout_s=float(multi_turn.tool_timeout_s),
            max_workers=int(multi_turn.tool_workers),
            max_response_length=int(multi_turn.max_tool_response_length),
            truncate_side=str(multi_turn.tool_response_truncate_side),
        )
        return cls(
            ChatTools(tokenizer, executor, str(multi_turn.format)),
            int(multi_turn.max_assistant_turns),
            int(multi_turn.max_parallel_calls),
            int(multi_turn.tool_workers),
        )

    def generate(
        self,
        engine: Engine,
        prompt_ids: np.ndarray,
        sampling: SamplingParams,
        attention_mask: np.ndarray,
        pad_token_id: int,
        first_index: int = 0,
    ) -> MultiTurnOutput:
        """Trajectories for a batch of left-padded prompts (see `generate_multi_turn`)."""
        return generate_multi_turn(
            engine,
            prompt_ids,
            sampling,
            self.tools,
            self.max_assistant_turns,
            self.max_parallel_calls,
            attention_mask,
            pad_token_id,
            first_index,
            self.tool_threads,
        )

    def extra_info(self, out: MultiTurnOutput, extra_info: list[Any]) -> list[Any]:
        """Each row's `extra_info` (a dict, or None) with its trajectory added."""
        decode = lambda ids: self.tools.tokenizer.decode(ids, skip_special_tokens=False)
        rows = []
        for row, base in enumerate(extra_info):
            calls = [
                {
                    "name": getattr(call, "name", None),
                    "arguments": getattr(call, "arguments", None),
                    "response": result.text,
                    "error": result.error or isinstance(call, ParseError),
                }
                for call, result in out.calls[row]
            ]
            messages = [{"role": kind, "content": decode(ids)} for kind, ids in out.turns[row]]
            info = dict(base or {})
            info.update(num_turns=int(out.num_turns[row]), messages=messages, tool_calls=calls)
            rows.append(info)
        return rows


def config_problems(c: Any) -> list[str]:
    """Problems of `actor_rollout_ref.rollout.multi_turn` for the start-up check, one line each
    naming its key: limits below 1, an unknown call format or truncation side; with `enable`, a
    missing or unreadable tool config file (unknown tool classes, bad entries, two tools of one
    name) and settings multi-turn rollouts cannot run with; without it, a tool config that would
    be ignored."""
    mt, rollout, problems = c.actor_rollout_ref.rollout.multi_turn, c.actor_rollout_ref.rollout, []
    for key in ("max_assistant_turns", "max_parallel_calls", "max_tool_response_length"):
        if mt[key] < 1:
            problems.append(f"{KEY}.{key}: must be >= 1 (got {mt[key]!r})")
    if mt.tool_workers < 1:
        problems.append(f"{KEY}.tool_workers: must be >= 1 (got {mt.tool_workers!r})")
    if not mt.tool_timeout_s > 0:
        problems.append(f"{KEY}.tool_timeout_s: must be > 0 seconds (got {mt.tool_timeout_s!r})")
    if mt.format not in PARSERS:
        problems.append(f"{KEY}.format: one of {sorted(PARSERS)} (got {mt.format!r})")
    if mt.tool_response_truncate_side not in TRUNCATE_SIDES:
        problems.append(
            f"{KEY}.tool_response_truncate_side: one of {TRUNCATE_SIDES} "
            f"(got {mt.tool_response_truncate_side!r})"
        )
    if not mt.enable:
        if mt.tool_config_path:
            problems.append(
                f"{KEY}.tool_config_path is set ({mt.tool_config_path!r}) but {KEY}.enable is "
                "False: the tools would be ignored; enable multi-turn or clear the path"
            )
        return problems
    if rollout.ignore_eos:
        problems.append(
            f"{KEY}.enable needs actor_rollout_ref.rollout.ignore_eos=False: an assistant turn "
            "ends at EOS, where its tool calls are read"
        )
    path = mt.tool_config_path
    if not path:
        problems.append(f"{KEY}.tool_config_path: empty; {KEY}.enable needs a tool config file")
    elif not os.path.isfile(path):
        problems.append(f"{KEY}.tool_config_path: no such file {path!r}")
    else:
        try:
            ToolExecutor(load_tools(path), max_workers=1).close()  # the tools load, names unique
        except (ValueError, OSError, yaml.YAMLError) as err:
            first = str(err).strip().splitlines()[0]
            problems.append(f"{KEY}.tool_config_path: {first}")
    return problems


def multi_turn_metrics(num_turns, tool_calls, tool_errors, row_mask) -> dict[str, float]:
    """`multi_turn/num_turns_mean|max`, `multi_turn/tool_calls` and `multi_turn/tool_errors`
    (calls made / failed per trajectory, mean) over the rows that are not padding."""
    rows = np.asarray(row_mask, bool)
    if not rows.any():
        return {}
    return {
        "multi_turn/num_turns_mean": float(np.mean(num_turns[rows])),
        "multi_turn/num_turns_max": float(np.max(num_turns[rows])),
        "multi_turn/tool_calls": float(np.mean(tool_calls[rows])),
        "multi_turn/tool_errors": float(np.mean(tool_errors[rows])),
    }
