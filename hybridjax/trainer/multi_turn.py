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
from typing import Any

import numpy as np

from hybridjax.models.tokenizer import Tokenizer
from hybridjax.rollout import Engine, SamplingParams
from hybridjax.rollout.agent_loop import MultiTurnOutput, generate_multi_turn
from hybridjax.tools import ParseError, ToolExecutor, load_tools
from hybridjax.tools.chat import ChatTools


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
