"""Reward servers on localhost, started and stopped here: the same scores as local scoring,
retries when a server dies, timeouts counted, 4xx for bad requests, the bearer token."""

import contextlib
import dataclasses
import os

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridjax.config.schema import base_config
from hybridjax.models import SequenceClassifier
from hybridjax.models.hf_io import save_pretrained
from hybridjax.rewards import RewardConfig, RewardFunctionError, RewardManager
from hybridjax.rewards.remote import TOKEN_ENV, RemoteClient, RemoteConfig, RewardServerError
from hybridjax.rewards.reward_model import score_with_model
from hybridjax.rewards.serve import start_local
from hybridjax.rl.reward import check_reward_servers
from tests.child_env import child_env

USER_CODE = """
import time
from hybridjax.rewards import default_compute_score

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "slow":
        time.sleep(2.0)
    if data_source == "custom":
        return {"score": len(solution_str) + extra_info["bonus"], "acc": 1.0}
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""
TOKEN = "s3cret"
ROWS = (
    ["#### 18", "18", "\\boxed{1/2}", "abc", "#### 1,234"],
    ["openai/gsm8k", "openai/gsm8k@flexible", "math", "custom", "arithmetic"],
    ["18", "18", "0.5", "", "1234"],
    [None, None, None, {"bonus": 0.5}, None],
    np.array([3, 2, 4, 3, 5]),
    6,
)


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "user_rewards.py"
    path.write_text(USER_CODE)
    return str(path)


@pytest.fixture(scope="module")
def server(user_file):
    """A rule server with the user's function, a bearer token and a 4 KiB request limit."""
    env = os.environ | {TOKEN_ENV: TOKEN}
    args = ["--custom_path", user_file, "--num_workers", "4", "--max_request_bytes", "4096"]
    process, url = start_local(args, env=env)
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)


def _remote(url, **changes):
    remote = dict(urls=url, timeout_s=10.0, max_retries=1, concurrency=2, batch_size=2) | changes
    return RewardConfig.from_config({"reward_model": {"remote": remote}})


def test_served_scores_equal_local_scores(server, user_file, token):
    local = RewardManager(RewardConfig(custom_path=user_file))
    remote = RewardManager(_remote(server))
    expected, got = local(*ROWS), remote(*ROWS)
    np.testing.assert_array_equal(got.scores, expected.scores)
    np.testing.assert_array_equal(got.scores, [1, 1, 1, 3.5, 1])
    np.testing.assert_array_equal(got.token_level_scores, expected.token_level_scores)
    assert got.metrics["reward/acc/mean"] == expected.metrics["reward/acc/mean"] == 1.0
    assert got.metrics["reward/remote_latency_ms"] > 0
    assert got.metrics["reward/num_retries"] == 0 and got.metrics["reward/num_timeouts"] == 0
    local.close(), remote.close()


def test_slow_server_timeouts_are_counted(server, token):
    manager = RewardManager(_remote(server, timeout_s=0.5, max_retries=1, batch_size=1))
    result = manager(["#### 1", "slow"], ["openai/gsm8k"] * 2, ["1", "1"], None, [2, 1], 2)
    np.testing.assert_array_equal(result.scores, [1, 0])  # on_error=zero
    assert result.metrics["reward/num_timeouts"] == 1.0
    assert result.metrics["reward/num_retries"] == 1.0  # the slow request was tried twice
    manager.close()


def test_bad_requests_get_4xx(server):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{server}/health").json() == {"status": "ok", "authorized": False}
    assert httpx.get(f"{server}/health", headers=auth).json()["kind"] == "rule"
    json_type = auth | {"Content-Type": "application/json"}
    malformed = httpx.post(f"{server}/score", content=b'{"rows": [', headers=json_type)
    assert malformed.status_code == 422 and "JSON" in malformed.text
    missing = httpx.post(f"{server}/score", json={"rows": [{"solution_str": "x"}]}, headers=auth)
    assert missing.status_code == 422 and "data_source" in missing.text
    nan = httpx.post(f"{server}/score", content=b'{"rows": NaN}', headers=json_type)
    assert nan.status_code == 422 and "rows" in nan.text  # was a 500 (the NaN echoed back)
    assert httpx.post(f"{server}/score", json={"rows": []}).status_code == 401
    wrong = httpx.post(f"{server}/score", json={"rows": []}, headers={"Authorization": "Bearer x"})
    assert wrong.status_code == 401
    big = {"rows": [{"data_source": "math", "solution_str": "x" * 5000}]}
    assert httpx.post(f"{server}/score", json=big, headers=auth).status_code == 413
    assert httpx.post(f"{server}/score", json={"rows": []}, headers=auth).json() == {"results": []}


def test_missing_token_is_a_clear_error_at_start(server, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(RewardServerError, match=f"{server} wants a bearer token: set {TOKEN_ENV}"):
        RewardManager(_remote(server))
    monkeypatch.setenv(TOKEN_ENV, "wrong")
    with pytest.raises(RewardServerError, match="wants a bearer token"):
        RewardManager(_remote(server))


def test_servers_of_different_rewards_are_refused(server, user_file, token):
    """Requests go round-robin over the URLs, so two servers must serve the same function."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{server}/health", headers=auth).json()["serves"] == (
        "user_rewards.py:compute_score {} (naive)"
    )
    process, builtin = start_local(env=os.environ | {TOKEN_ENV: TOKEN})
    try:
        with pytest.raises(RewardServerError, match="serve different rewards.*built-in rules"):
            RewardManager(_remote(f"{server},{builtin}"))
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_health_check_names_the_url():
    with pytest.raises(RewardServerError, match=r"reward server http://127.0.0.1:9 failed"):
        RemoteClient(RemoteConfig(urls=("http://127.0.0.1:9",), timeout_s=2), "rule")
    with pytest.raises(ValueError, match="not an http"):
        RemoteConfig(urls=("localhost:8000",))


def test_trainer_checks_the_servers_first(server, token):
    config = base_config()
    config.reward_model.remote.urls = f"{server},http://127.0.0.1:9"
    with pytest.raises(RewardServerError, match=r"reward server http://127.0.0.1:9 failed"):
        check_reward_servers(config)
    config.reward_model.enable = True  # no model.path: the URLs must serve a reward model
    config.reward_model.remote.urls = server
    with pytest.raises(RewardServerError, match=f"{server} serves kind 'rule', expected 'model'"):
        check_reward_servers(config)


def test_killed_server_retries_then_on_error(user_file, server, token):
    env = os.environ | {TOKEN_ENV: TOKEN}
    process, doomed = start_local(["--custom_path", user_file, "--num_workers", "1"], env=env)
    # Two servers: requests to the dead one are retried on the live one.
    both = RewardManager(_remote(f"{doomed},{server}", batch_size=1))
    alone = RewardManager(_remote(doomed, max_retries=2))
    strict = RewardManager(dataclasses.replace(_remote(doomed), on_error="raise"))
    for manager in (both, alone, strict):
        assert manager(*ROWS).metrics["reward/num_errors"] == 0  # the first batch, served
    process.kill()
    process.wait()
    result = both(*ROWS)
    np.testing.assert_array_equal(result.scores, [1, 1, 1, 3.5, 1])
    assert result.metrics["reward/num_retries"] >= 2
    result = alone(*ROWS)
    assert result.metrics["reward/num_errors"] == 5 and not result.scores.any()
    assert result.metrics["reward/num_retries"] == 2 * 3  # 3 requests, 2 retries each
    with pytest.raises(RewardFunctionError, match=f"row 0 .*reward server {doomed}"):
        strict(*ROWS)
    both.close(), alone.close(), strict.close()


def test_model_server_scores_equal_the_local_forward(tmp_path):
    """A `*ForSequenceClassification` checkpoint served on 2 simulated CPU devices scores
    unpadded token ids as `score_with_model` scores the padded batch in this process."""
    from tests.rewards.test_reward_model import CONFIG, P, R

    rng = np.random.default_rng(3)
    abstract = nnx.eval_shape(lambda: SequenceClassifier(CONFIG, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    state = jax.tree.map(lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape), x.dtype), state)
    model = nnx.merge(graphdef, state)
    save_pretrained(model, tmp_path / "rm")
    lengths = [(8, 6), (3, 2), (5, 0), (1, 4), (2, 5)]
    prompts = np.zeros((len(lengths), P), np.int32)
    responses = np.zeros((len(lengths), R), np.int32)
    pmask, rmask = np.zeros_like(prompts), np.zeros_like(responses)
    for i, (p, r) in enumerate(lengths):
        prompts[i, P - p :], pmask[i, P - p :] = rng.integers(1, 64, p), 1
        responses[i, :r], rmask[i, :r] = rng.integers(1, 64, r), 1
    _, expected = score_with_model(model, prompts, pmask, responses, rmask)

    env = child_env(devices=2)
    process, url = start_local(["--model_path", str(tmp_path / "rm")], env=env)
    try:
        health = httpx.get(f"{url}/health").json()
        assert health["kind"] == "model" and health["devices"] == 2 and health["authorized"]
        client = RemoteClient(RemoteConfig(urls=(url,), batch_size=3), "model")
        outcomes = client.score_tokens(
            [p[m == 1].tolist() for p, m in zip(prompts, pmask, strict=True)],
            [r[m == 1].tolist() for r, m in zip(responses, rmask, strict=True)],
        )
        client.close()
        np.testing.assert_allclose([o.score for o in outcomes], expected, atol=1e-4)
        with pytest.raises(RewardServerError, match="serves kind 'model', expected 'rule'"):
            RemoteClient(RemoteConfig(urls=(url,)), "rule")
        bad = httpx.post(f"{url}/score_tokens", json={"prompts": [[-1]], "responses": [[1]]})
        assert bad.status_code == 422
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_connections_that_never_finish_their_headers_are_closed():
    """uvicorn waits for request headers for ever: clients holding half-sent headers (no token
    needed) used up the server's open files and it refused everyone. Now each is closed
    `--header_timeout_s` after it opened or after its last answer; whole requests are served."""
    import socket
    import time

    process, url = start_local(["--header_timeout_s", "1"])
    port = int(url.rsplit(":", 1)[1])
    try:
        idle = socket.create_connection(("127.0.0.1", port), timeout=10)
        half = socket.create_connection(("127.0.0.1", port), timeout=10)
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no blank line: never done
        again = socket.create_connection(("127.0.0.1", port), timeout=10)
        again.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # answered, kept alive,
        assert again.recv(4096).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        with contextlib.suppress(OSError):  # closed while trickling: sending fails
            for _ in range(6):  # then a second request trickled a byte every 0.5 s
                again.sendall(b"G")
                time.sleep(0.5)
        for sock in (idle, half, again):
            assert _closed_by_the_server(sock)
        assert time.monotonic() - start < 8
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=30)


def _closed_by_the_server(sock) -> bool:
    """Whether the server ends the connection (what it still sends, the rest of an answer, is
    read first) before the socket's timeout."""
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
