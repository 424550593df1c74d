"""Rewards that cannot poison the update: scores checked in float32 (overflow and range are
failures), non-numbers failing their row, remote answers that are not the protocol retried with
backoff and named, and the guard that stops a run whose rewards mostly fail."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from hybridjax.rewards import RewardConfig, RewardManager, RewardResult
from hybridjax.rewards.guard import RewardFailureError, RewardFailureGuard
from hybridjax.rewards.remote import RemoteClient, RemoteConfig
from hybridjax.rewards.scoring import Outcome, normalize
from tests.http_testing import serve


@pytest.mark.parametrize(
    "value, kind, message",
    [
        (1e300, "nonfinite", "1e+300 (inf in float32)"),
        (-3.5e38, "nonfinite", "inf in float32"),
        (2e6, "nonfinite", "beyond ±1e+06"),
        (float("nan"), "nonfinite", "returned nan"),
        ("1.0", "error", "returned str '1.0'"),
        (None, "error", "returned NoneType"),
        ([1.0], "error", "returned list"),
        ({"score": "high"}, "error", "returned str 'high'"),
        ({"acc": 1.0}, "error", "no 'score' key"),
        (np.array([1.0, 2.0]), "error", "returned ndarray"),
    ],
)
def test_scores_that_would_poison_fail_their_row(value, kind, message):
    outcome = normalize(value)
    assert outcome.kind == kind and message in outcome.error and outcome.score == 0.0


@pytest.mark.parametrize("value", [1, 0.25, True, np.float64(2.5), np.int8(3), np.array(4.0)])
def test_numbers_of_any_numeric_type_score(value):
    outcome = normalize(value)
    assert outcome.kind == "ok" and outcome.score == float(value)
    assert normalize({"score": value, "acc": 1}).extras == {"acc": 1}


def test_overflowing_scores_never_reach_the_batch():
    scores = {"a": 1e300, "b": 1.0, "c": "x", "d": 0.5}
    manager = RewardManager(RewardConfig(), compute_score=lambda s, text, *a: scores[text])
    result = manager(["a", "b", "c", "d"], ["s"] * 4, ["t"] * 4, None, [1] * 4, 1)
    assert np.isfinite(result.token_level_scores).all()
    np.testing.assert_array_equal(result.scores, [0.0, 1.0, 0.0, 0.5])
    assert result.metrics["reward/num_nonfinite"] == 1 and result.metrics["reward/num_errors"] == 1
    assert result.first_error.startswith("nonfinite: reward function returned 1e+300")
    manager.close()


@pytest.mark.parametrize(
    "row, kind",
    [
        ({"kind": "ok", "score": 1e300}, "nonfinite"),
        ({"kind": "ok", "score": "1"}, "error"),
        ({"kind": "ok"}, "error"),
        ({"kind": "exploded"}, "error"),
        ("garbage", "error"),
        ({"kind": "ok", "score": 0.5, "extras": [1]}, "ok"),
    ],
)
def test_server_result_rows_are_checked_like_local_ones(row, kind):
    assert Outcome.from_json(row).kind == kind


def _result(failed: int, rows: int = 8, error: str = "error: boom") -> RewardResult:
    metrics = {"reward/num_errors": float(failed), "reward/num_timeouts": 0.0}
    return RewardResult(np.zeros((rows, 2)), np.zeros(rows), {}, metrics, error if failed else "")


def test_guard_stops_after_consecutive_failed_steps_and_holds_their_checkpoints(caplog):
    caplog.set_level(logging.INFO)
    guard = RewardFailureGuard(max_consecutive=3)
    guard.count(_result(4), 1)  # half: not most
    assert guard.may_save()
    guard.count(_result(5), 2)
    assert not guard.may_save() and "step 2 is not checkpointed" in caplog.text
    guard.count(_result(0), 3)  # a good step resets the streak
    assert guard.may_save()
    guard.count(_result(8), 4)
    guard.count(_result(7, error="error: reward server http://h:1/score answered 502"), 5)
    with pytest.raises(RewardFailureError) as err:
        guard.count(_result(8), 6)
    message = str(err.value)
    assert "Steps 4-6: most rows failed in 3 consecutive steps" in message
    assert "reward_model.max_consecutive_failed_steps=3" in message
    assert "8 of 8 rows' rewards failed at step 6 (errors 8, timeouts 0, nonfinite 0)" in message
    assert "before saving a checkpoint" in message
    guard.count(None, 7)  # a pipeline without a reward stage


# ------------------------------------------------------------------ a misbehaving reward server

CALLS: list[float] = []


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"kind": "rule", "serves": "x"}

    @app.post("/score")
    async def score(request: Request):
        CALLS.append(time.monotonic())
        mode = (await request.json())["rows"][0]["solution_str"]
        if mode == "html":
            return PlainTextResponse("<html>Bad Gateway</html>", status_code=200)
        if mode == "502":
            return PlainTextResponse("upstream down", status_code=502)
        if mode == "short":
            return {"results": []}
        if mode == "flaky" and len(CALLS) % 2:
            return PlainTextResponse("{not json", status_code=200)
        return {"results": [{"kind": "ok", "score": 1.0}]}

    return app


@pytest.fixture(scope="module")
def url():
    yield from serve(_app())


def _client(url, **kw) -> RemoteClient:
    return RemoteClient(RemoteConfig((url,), timeout_s=5, max_retries=2, **kw), "rule")


@pytest.mark.parametrize(
    "mode, shown",
    [
        ("html", "answered 200: '<html>Bad Gateway</html>'"),
        ("502", "answered 502: 'upstream down'"),
        ("short", "answered 200: '{\"results\":[]}'"),
    ],
)
def test_bad_answers_are_retried_with_backoff_and_named(url, mode, shown):
    client = _client(url, retry_backoff_s=0.2)
    CALLS.clear()
    (outcome,) = client.score_rows([("s", mode, "t", None)])
    assert outcome.kind == "error" and f"reward server {url}/score {shown}" in outcome.error
    assert len(CALLS) == 3 and client.num_retries == 2
    gaps = np.diff(CALLS)
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4  # 0.2 s, then doubled
    client.close()


def test_a_retry_recovers_a_malformed_answer(url):
    client = _client(url, retry_backoff_s=0.0)
    CALLS.clear()
    (outcome,) = client.score_rows([("s", "flaky", "t", None)])
    assert outcome == Outcome(1.0) and client.num_retries == 1
    client.close()


def test_backoff_key_is_validated():
    with pytest.raises(ValueError, match="retry_backoff_s"):
        RemoteConfig(("http://x",), retry_backoff_s=-1)
