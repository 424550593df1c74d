"""The reward server authenticates before it reads: wrong-token bodies are never read (the
server's memory stays flat under concurrent 46 MB requests), an oversized Content-Length is
refused before its body, a stalled body is dropped, and `/health` tells a caller without the
token only that the server is alive."""

import json
import os
import socket
import threading
import time

import httpx
import psutil
import pytest

from hybridjax.rewards.remote import TOKEN_ENV
from hybridjax.rewards.serve import start_local

TOKEN = "s3cret"
SECRET_KWARG = "sk-live-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A rule server with a token, a user function holding a secret in its kwargs, the
    default 64 MiB body limit and a 1 s body deadline."""
    path = tmp_path_factory.mktemp("rewards") / "secret_rewards.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, "
                    "**kwargs):\n    return 1\n")  # fmt: skip
    args = ["--custom_path", str(path), "--num_workers", "1", "--body_timeout_s", "1"]
    args += ["--reward_kwargs", json.dumps({"api_key": SECRET_KWARG})]
    process, url = start_local(args, env=os.environ | {TOKEN_ENV: TOKEN})
    yield process, url
    process.terminate()
    process.wait(timeout=30)


def _raw(url: str, head: bytes, body: bytes = b"", wait_s: float = 10.0) -> tuple[bytes, float]:
    """Sends `head` and `body` on a raw connection; returns everything the server sent until
    it closed the connection, and the seconds that took."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(head + body)
        answer = b""
        while chunk := s.recv(1 << 16):
            answer += chunk
    return answer, time.monotonic() - start


def _head(length: int, token: str = TOKEN) -> bytes:
    return (
        f"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def test_wrong_token_bodies_are_never_read(server):
    process, url = server
    rss = psutil.Process(process.pid)
    body = b'{"rows": [' + b" " * (46 << 20) + b"]}"  # 46 MB, as in the probe
    before, peak, statuses = rss.memory_info().rss, [0], []

    def watch(stop):
        while not stop.is_set():
            peak[0] = max(peak[0], rss.memory_info().rss)
            time.sleep(0.01)

    def post(token):
        try:
            headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
            statuses.append(httpx.post(f"{url}/score", content=body, headers=headers).status_code)
        except httpx.TransportError:  # the server closed the connection before the body was in
            statuses.append("dropped")

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,))
    watcher.start()
    senders = [threading.Thread(target=post, args=(t,)) for t in ["wrong", ""] * 4]
    for t in senders:
        t.start()
    for t in senders:
        t.join(timeout=60)
    stop.set()
    watcher.join()
    assert len(statuses) == 8 and set(statuses) <= {401, "dropped"}, statuses
    assert peak[0] - before < 20 << 20, (before >> 20, peak[0] >> 20)  # MiB: flat


def test_an_oversized_content_length_is_refused_before_its_body(server):
    _, url = server
    answer, seconds = _raw(url, _head(10**10))  # nothing of the body is ever sent
    assert answer.startswith(b"HTTP/1.1 413") and b"bytes > 67108864" in answer and seconds < 5
    answer, _ = _raw(url, _head(10**10, token="wrong"))
    assert answer.startswith(b"HTTP/1.1 401")  # the token first: nothing else is said


def test_a_stalled_body_is_dropped(server):
    _, url = server
    answer, seconds = _raw(url, _head(100), body=b'{"rows": ')  # 9 of 100 bytes, then silence
    assert answer.startswith(b"HTTP/1.1 408") and b"within 1.0 s" in answer
    assert 0.9 < seconds < 5
    ok = httpx.post(f"{url}/score", json={"rows": []}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.json() == {"results": []}  # the server goes on


def test_health_without_the_token_says_only_alive(server):
    _, url = server
    anonymous = httpx.get(f"{url}/health")
    assert anonymous.json() == {"status": "ok", "authorized": False}
    assert SECRET_KWARG not in anonymous.text
    health = httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert health["kind"] == "rule" and health["authorized"] and SECRET_KWARG in health["serves"]
