"""The reward server's gate on its own (no server): a body framed by chunks, whatever
`Content-Length` it also claims, is refused before it is read, and no body is read past
`max_bytes`."""

import asyncio

from hybridjax.rewards.request_guard import RequestGuard

MAX_BYTES = 1000


def _run(headers: dict[bytes, bytes], chunks: int) -> tuple[list[int], int]:
    """(statuses the guard sent, chunks of 600 bytes it read) for a POST /score with
    `headers` and a body of `chunks` chunks; the app behind it answers 200."""
    read, sent = [0], []

    async def receive():
        read[0] += 1
        more = read[0] < chunks
        return {"type": "http.request", "body": b"x" * 600, "more_body": more}

    async def send(message):
        if message["type"] == "http.response.start":
            sent.append(message["status"])

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard = RequestGuard(app, token="t", max_bytes=MAX_BYTES, body_timeout_s=5.0)
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/score",
        "headers": [(b"authorization", b"Bearer t"), *headers.items()],
    }
    asyncio.run(guard(scope, receive, send))
    return sent, read[0]


def test_chunked_body_with_a_small_content_length_is_refused_unread():
    sent, read = _run({b"content-length": b"10", b"transfer-encoding": b"chunked"}, 100)
    assert sent == [411] and read == 0


def test_a_body_longer_than_its_content_length_is_not_read_past_max_bytes():
    sent, read = _run({b"content-length": b"10"}, 100)
    assert sent == [413] and read == 2
    assert _run({b"content-length": b"10"}, 1) == ([200], 1)
