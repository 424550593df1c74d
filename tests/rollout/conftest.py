"""Fixtures of the rollout tests."""

import dataclasses

import pytest
from rollout_testing import TINY, make_model, make_prompts, naive_greedy

from hybridjax.rollout import Engine, RolloutConfig


@pytest.fixture(scope="session")
def eos_model():
    """The tiny model with an EOS id that greedy decoding of prompt 0 emits as its 4th token."""
    first = naive_greedy(make_model(), make_prompts()[0], 4)
    eos = first[3]
    assert eos not in first[:3]
    return make_model(dataclasses.replace(TINY, eos_token_id=eos))


ENGINE_CONFIG = RolloutConfig(
    page_size=4, max_num_seqs=4, prompt_length=16, response_length=8, decode_steps_per_call=3
)


@pytest.fixture(scope="session")
def engine(eos_model):
    """One engine shared by the tests (compiles are per engine): 4 slots, 4-token pages,
    default pool (4 slots × 6 pages), 3 decode steps per host round trip."""
    return Engine(eos_model, ENGINE_CONFIG)
