"""Reward manager: score placement, futures, dict extras, error policy, custom functions."""

import concurrent.futures
import math
import threading
from pathlib import Path

import numpy as np
import pytest
from ml_collections import ConfigDict

from hybridjax.models.tokenizer import Tokenizer
from hybridjax.rewards import (
    RewardConfig,
    RewardFunctionError,
    RewardManager,
    decode_responses,
    place_scores,
)

ASSET = Path(__file__).parents[2] / "hybridjax" / "assets" / "tokenizers" / "gsm8k_bpe"


def test_place_scores_on_last_valid_token():
    out = place_scores(np.array([1.0, 5.0, -2.0]), np.array([3, 0, 4]), width=4)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(
        out, [[0, 0, 1.0, 0], [0, 0, 0, 0], [0, 0, 0, -2.0]]
    )  # the empty response carries no reward anywhere
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        place_scores(np.ones(1), np.array([5]), width=4)


def test_gsm8k_batch():
    manager = RewardManager(RewardConfig(num_workers=2))
    responses = ["#### 18", "The answer is 18", "#### 1,234", ""]
    result = manager(
        responses,
        ["openai/gsm8k", "openai/gsm8k", "arithmetic", "openai/gsm8k"],
        ["18", "18", "1234", "18"],
        None,
        np.array([3, 5, 6, 0]),
        8,
    )
    np.testing.assert_array_equal(result.scores, [1.0, 0.0, 1.0, 0.0])
    assert result.token_level_scores.shape == (4, 8)
    assert result.token_level_scores[0, 2] == 1.0 and result.token_level_scores[2, 5] == 1.0
    assert result.token_level_scores.sum() == 2.0
    assert result.metrics == {
        "reward/num_errors": 0.0,
        "reward/num_timeouts": 0.0,
        "reward/num_nonfinite": 0.0,
    }
    manager.close()


def test_submit_returns_a_future_before_scoring_finishes():
    release = threading.Event()

    def slow(data_source, solution_str, ground_truth, extra_info=None):
        release.wait(timeout=10)
        return 1.0

    manager = RewardManager(RewardConfig(num_workers=2), compute_score=slow)
    future = manager.submit(["a", "b", "c"], ["s"] * 3, ["x"] * 3, None, np.array([1, 1, 1]), 2)
    assert isinstance(future, concurrent.futures.Future) and not future.done()
    release.set()
    np.testing.assert_array_equal(future.result(timeout=10).scores, [1.0, 1.0, 1.0])
    manager.close()


def _flaky(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise ZeroDivisionError("boom")
    if solution_str == "nan":
        return float("nan")
    return {"score": 1.0, "acc": 1.0, "pred": solution_str}


def test_errors_scored_zero_and_counted():
    manager = RewardManager(RewardConfig(on_error="zero"), compute_score=_flaky)
    result = manager(["ok", "raise", "nan", "ok"], ["s"] * 4, ["t"] * 4, None, [1, 1, 1, 2], 2)
    np.testing.assert_array_equal(result.scores, [1.0, 0.0, 0.0, 1.0])
    assert result.metrics["reward/num_errors"] == 1.0
    assert result.metrics["reward/num_nonfinite"] == 1.0
    assert np.isfinite(result.token_level_scores).all()
    # Extra keys of dict results: numeric ones become metrics, missing rows are NaN.
    assert result.metrics["reward/acc/mean"] == 1.0
    assert math.isnan(result.extra["acc"][1]) and result.extra["acc"][3] == 1.0
    assert result.extra["pred"][0] == "ok" and "reward/pred/mean" not in result.metrics
    manager.close()


def test_error_policy_raise_names_the_row():
    manager = RewardManager(RewardConfig(on_error="raise"), compute_score=_flaky)
    future = manager.submit(["ok", "ok", "nan"], ["s", "s", "src/x"], ["t"] * 3, None, [1] * 3, 1)
    with pytest.raises(RewardFunctionError, match=r"row 2 \(data_source='src/x'\)"):
        future.result()
    manager.close()


def test_dict_without_score_is_an_error():
    fn = lambda data_source, solution_str, ground_truth, extra_info=None: {"acc": 1.0}
    manager = RewardManager(RewardConfig(on_error="raise"), compute_score=fn)
    with pytest.raises(RewardFunctionError, match="no 'score' key"):
        manager(["x"], ["s"], ["t"], None, [1], 1)
    manager.close()


CUSTOM = """
def my_reward(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return float(solution_str.strip() == ground_truth) + bonus + extra_info["weight"]
"""


def test_custom_reward_function_from_config(tmp_path):
    (tmp_path / "my_rewards.py").write_text(CUSTOM)
    config = ConfigDict(
        dict(
            reward_model=dict(enable=False, on_error="raise", num_workers=3),
            custom_reward_function=dict(
                path=str(tmp_path / "my_rewards.py"),
                name="my_reward",
                reward_kwargs=dict(bonus=0.5),
            ),
        )
    )
    reward_config = RewardConfig.from_config(config)
    assert reward_config.num_workers == 3 and reward_config.on_error == "raise"
    manager = RewardManager(reward_config)
    result = manager(
        ["7", "8"], ["any", "any"], ["7", "7"], [{"weight": 1}, {"weight": 0}], [1, 1], 1
    )
    np.testing.assert_array_equal(result.scores, [2.5, 0.5])
    manager.close()


def test_custom_reward_function_errors(tmp_path):
    (tmp_path / "r.py").write_text(CUSTOM)
    with pytest.raises(AttributeError, match="'missing' is not a function"):
        RewardManager(RewardConfig(custom_path=str(tmp_path / "r.py"), custom_name="missing"))
    with pytest.raises(FileNotFoundError, match="nowhere.py"):
        RewardManager(RewardConfig(custom_path=str(tmp_path / "nowhere.py")))
    with pytest.raises(ValueError, match="reward_model.on_error='ignore'"):
        RewardConfig(on_error="ignore")


def test_default_config_uses_builtin_dispatch():
    config = RewardConfig.from_config(ConfigDict(dict(custom_reward_function=dict(path=""))))
    manager = RewardManager(config)
    assert manager(["#### 3"], ["openai/gsm8k"], ["3"], None, [2], 2).scores.tolist() == [1.0]
    manager.close()


def test_unknown_data_source_fails_at_once():
    manager = RewardManager(RewardConfig(on_error="zero"))
    with pytest.raises(ValueError, match=r"data_source \['my/task'\]; known: .*openai/gsm8k"):
        manager.submit(["#### 1"], ["my/task"], ["1"], None, [1], 1)
    manager.close()


def test_decode_responses_uses_valid_tokens_only():
    tok = Tokenizer.from_pretrained(ASSET)
    a, b = tok.encode("#### 18"), tok.encode("hi")
    width = len(a) + 2
    responses = np.full((2, width), tok.pad_token_id, np.int32)
    mask = np.zeros((2, width), np.int32)
    responses[0, : len(a)], mask[0, : len(a)] = a, 1
    responses[1, : len(b)], mask[1, : len(b)] = b, 1
    responses[1, len(b)] = tok.token_to_id("7")  # a token past the mask is ignored
    assert decode_responses(tok, responses, mask) == ["#### 18", "hi"]
