"""Which variables and votes validation hands to verl's metrics (hybridjax.rl.evaluation)."""

import types

import numpy as np

from hybridjax.rl.evaluation import ANSWER_EXTRACTORS, _variables


def test_built_in_answers_are_normalised_votes():
    strict = ANSWER_EXTRACTORS["openai/gsm8k"]
    assert strict("so #### 1,234") == strict("#### 1234.0") == "1234"
    assert strict("Answer: 7") is None  # no answer is a vote of its own
    assert ANSWER_EXTRACTORS["openai/gsm8k@flexible"]("it is 7 or 8.") == "8"
    assert ANSWER_EXTRACTORS["math"]("thus $\\boxed{\\dfrac{1}{2}}$") == "\\frac{1}{2}"


def test_built_in_rules_score_acc_and_vote_with_their_answers():
    builtin = types.SimpleNamespace(builtin=True)  # RewardManager with the built-in rules
    variables, votes = _variables(
        [1.0, 0.0], [{}, {}], ["arithmetic"] * 2, ["#### 3", "Answer: 3"], builtin
    )
    assert variables == {"acc": [1.0, 0.0]} and votes == ["3", None]
    # a data source without a built-in answer reader: no votes, so no maj@ (as verl)
    assert _variables([1.0], [{}], ["my/source"], ["x"], builtin)[1] is None


def test_reward_dicts_supply_acc_pred_and_extra_keys():
    custom = types.SimpleNamespace(builtin=False)  # a custom function or reward servers
    extras = [
        {"acc": np.float32(1), "pred": "A", "format": np.float32(1), "note": "ok"},
        {"acc": np.float32(0), "pred": "B", "format": np.float32(0), "note": "bad"},
    ]
    variables, votes = _variables([0.5, -0.5], extras, ["s", "s"], ["", ""], custom)
    assert variables == {"acc": [1.0, 0.0], "reward": [0.5, -0.5], "format": [1.0, 0.0]}
    assert votes == ["A", "B"]
    # a custom function without `pred`: its score is `acc`, and no votes
    assert _variables([0.5], [{}], ["arithmetic"], ["#### 1"], custom) == ({"acc": [0.5]}, None)
