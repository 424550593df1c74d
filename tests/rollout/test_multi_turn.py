"""Multi-turn rollouts in the paged engine (`hybridjax.rollout.agent_loop`) with a scripted tool
side: trajectories, masks, log-probs against the trainer's forward over the whole trajectory,
reuse of earlier turns' KV pages, and other slots decoding while a tool runs."""

import dataclasses
import threading

import numpy as np
import pytest
from rollout_testing import make_model, make_prompts, trainer_log_probs

from hybridjax.rollout import Engine, RolloutConfig, SamplingParams
from hybridjax.rollout.agent_loop import generate_multi_turn

PROMPTS = make_prompts((5, 9, 1, 12), seed=3)
STOP = (11, 23, 35, 47, 59, 71, 83)  # end of an assistant turn (a chat model's EOS)
CONFIG = RolloutConfig(
    page_size=32, max_num_seqs=2, prompt_length=16, response_length=40, decode_steps_per_call=4
)


class Scripted:
    """Every turn calls one tool; its response is `length` tokens derived from the turn."""

    def __init__(self, length=3):
        self.length = length

    def parse(self, turn):
        return [("echo", tuple(turn))]

    def execute(self, calls):
        return [sum(turn) % 90 + 1 for _, turn in calls]

    def is_error(self, result):
        return result % 7 == 0

    def render(self, calls, results):
        return [(results[0] + i) % 96 + 1 for i in range(self.length)]


SAMPLING = SamplingParams(n=2, temperature=1.0, max_tokens=40, stop_token_ids=STOP, seed=5)


@pytest.fixture(scope="module")
def engine():
    return Engine(make_model(), CONFIG)


@pytest.fixture(scope="module")
def run(engine):
    """(output, prefill tokens it ran) of the scripted rollout: 4 prompts × 2 samples, 3 turns."""
    before = engine.num_prefill_tokens
    out = generate_multi_turn(engine, PROMPTS, SAMPLING, Scripted(), max_assistant_turns=3)
    return out, engine.num_prefill_tokens - before


def _segments_match(out, row, handler):
    """The row's response is its turns laid end to end; mask 1 exactly on assistant tokens."""
    tokens, mask = [], []
    for kind, ids in out.turns[row]:
        tokens += ids
        mask += [int(kind == "assistant")] * len(ids)
    n = len(tokens)
    assert out.responses[row, :n].tolist() == tokens
    assert out.response_mask[row].tolist() == mask + [0] * (out.responses.shape[1] - n)
    return tokens


def test_tool_turns_masks_and_log_probs_equal_the_trainer_forward(engine, run):
    handler, (out, prefilled) = Scripted(), run
    assert engine.num_active == 0 and engine.num_free_pages == engine.num_pages
    assert out.responses.shape == (8, 40)
    assert max(out.num_turns) == 3 and min(out.num_turns) >= 1
    assert sum(out.num_turns >= 2) >= 4  # most trajectories called a tool and went on
    fed_tool_tokens = 0
    for row in range(8):
        prompt = PROMPTS[row // 2]
        tokens = _segments_match(out, row, handler)
        kinds = [k for k, _ in out.turns[row]]
        assert kinds[::2] == ["assistant"] * len(kinds[::2]) and set(kinds[1::2]) <= {"tool"}
        assert (
            out.tool_calls[row]
            == len(kinds[1::2])
            == out.num_turns[row] - (kinds[-1] == "assistant")
        )
        for i, (kind, ids) in enumerate(out.turns[row]):
            if kind == "tool":
                full = handler.render(None, handler.execute([("echo", out.turns[row][i - 1][1])]))
                last = i + 1 == len(kinds)
                assert ids == full if not last else full[: len(ids)] == ids
                if last:  # a tool response that ends the trajectory: it did not fit
                    assert len(tokens) == 40 and out.finish_reason[row] == "length"
                fed_tool_tokens += len(ids) * (not last)
        # the engine's log-probs of model tokens = one forward over prompt + whole trajectory
        mask = out.response_mask[row, : len(tokens)].astype(bool)
        expect = trainer_log_probs(make_model(), prompt, tokens, 1.0)
        np.testing.assert_allclose(
            out.rollout_log_probs[row, : len(tokens)][mask], expect[mask], atol=1e-5
        )
        assert np.all(out.rollout_log_probs[row][~out.response_mask[row].astype(bool)] == 0)
    # earlier turns are never recomputed: prompts once (all but their last token), then only
    # the tool tokens that decoding continued after
    # (a prompt is prefilled once for its n samples)
    assert prefilled == sum(len(p) - 1 for p in PROMPTS) + fed_tool_tokens


def test_a_tool_response_that_does_not_fit_ends_the_trajectory(engine):
    """Per-request budgets (40 and 24 tokens): a 20-token tool response fits the first
    trajectory once at most; whatever does not fit is cut and ends the trajectory."""
    handler = Scripted(length=20)
    sp = [
        SamplingParams(temperature=1.0, max_tokens=m, stop_token_ids=STOP, seed=5) for m in (40, 24)
    ]
    out = generate_multi_turn(engine, PROMPTS[:2], sp, handler, max_assistant_turns=5)
    assert [k for k, _ in out.turns[0]][:2] == ["assistant", "tool"]
    for row, limit in enumerate((40, 24)):
        tokens = _segments_match(out, row, handler)
        assert len(tokens) <= limit
        if out.turns[row][-1][0] == "tool":
            assert len(tokens) == limit and out.finish_reason[row] == "length"
    assert engine.num_free_pages == engine.num_pages


def test_other_slots_decode_while_a_tool_runs(engine, run):
    """Prompt 0's tool blocks until another trajectory finished a later turn: the loop must keep
    decoding the other slots meanwhile (a loop that waited for the tool would time out)."""
    released = threading.Event()

    class Blocking(Scripted):
        def execute(self, calls):
            if calls[0][1] == first_turn_of_prompt0[0]:
                self.waited = released.wait(timeout=30)
            else:
                released.set()
            return super().execute(calls)

    plain = run[0]
    first_turn_of_prompt0 = [tuple(plain.turns[0][0][1])]
    handler = Blocking()
    out = generate_multi_turn(engine, PROMPTS, SAMPLING, handler, max_assistant_turns=3)
    assert handler.waited
    # the results do not depend on when tools finish (other decode batches: float rounding)
    np.testing.assert_array_equal(out.responses, plain.responses)
    np.testing.assert_allclose(out.rollout_log_probs, plain.rollout_log_probs, atol=1e-5)


def test_turn_limit_and_errors_are_counted(engine):
    sp = SamplingParams(temperature=1.0, max_tokens=40, stop_token_ids=STOP, seed=5)
    out = generate_multi_turn(engine, PROMPTS, sp, Scripted(), max_assistant_turns=1)
    assert np.all(out.num_turns == 1) and np.all(out.tool_calls == 0)
    assert np.all(out.response_mask.sum(-1) == [len(t[0][1]) for t in out.turns])
    with pytest.raises(ValueError, match="max_assistant_turns"):
        generate_multi_turn(engine, PROMPTS, sp, Scripted(), max_assistant_turns=0)


@pytest.mark.slow  # two engines compiled
def test_a_pool_too_small_preempts_and_gives_the_same_trajectories():
    """4 slots over 4 pages of 32 tokens (a group's worst case, 2 × 2 pages, still fits): the
    trajectories grow past one page each, are preempted in flight (tool tokens included) and
    recomputed from their tokens on readmission; turns, masks and log-probs equal those of the
    same engine with every slot's worst case in its pool (8 pages)."""
    config = dataclasses.replace(CONFIG, max_num_seqs=4)
    rollout = lambda engine: generate_multi_turn(
        engine, PROMPTS, SAMPLING, Scripted(), max_assistant_turns=3
    )
    big = Engine(make_model(), config)
    small = Engine(make_model(), dataclasses.replace(config, num_pages=4))
    want, got = rollout(big), rollout(small)
    assert big.num_preemptions == 0 and small.num_preemptions > 0
    assert got.turns == want.turns
    np.testing.assert_array_equal(got.responses, want.responses)
    np.testing.assert_array_equal(got.response_mask, want.response_mask)
    np.testing.assert_allclose(got.rollout_log_probs, want.rollout_log_probs, atol=1e-5)
    assert list(got.finish_reason) == list(want.finish_reason)
    assert small.num_active == 0 and small.num_free_pages == small.num_pages
