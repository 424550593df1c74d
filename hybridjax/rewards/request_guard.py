"""The reward server's gate (ASGI middleware): nothing of a request's body is read before the
request is authenticated and its size allowed, and a body must arrive within a deadline.

For every request but `GET /health`, in this order, each refusal a JSON `{"detail"}` answer
sent with `Connection: close` (the connection is dropped, the rest of the body never read):
  1. 401 when the server has a token and the `Authorization` header is not `Bearer <token>`;
  2. 411 without a numeric `Content-Length` on a POST or with a `Transfer-Encoding` (the body
     would be framed by chunks, not by the length checked), 413 when it exceeds `max_bytes`
     (or the body read grows past it);
  3. 408 when the whole body has not arrived `body_timeout_s` seconds after the headers (a
     stalled or trickling client).
An accepted body is read here and handed on to the app, so the app's own parsing never waits
on the network. `/health` is the app's: it tells an unauthenticated caller only that the
server is alive.

Before any of that, a connection must send a whole request's headers within
`header_timeout_s` of opening (or of its previous answer), else it is closed
(`header_deadline_protocol`, uvicorn's h11 protocol with a timer): uvicorn waits for headers
for ever, so clients holding half-sent headers, no token needed, used up the server's open
files and it refused everyone (256 of them with a 256-file limit).
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from fastapi.responses import JSONResponse

Scope = dict[str, Any]


def token_matches(authorization: str | bytes, token: str) -> bool:
    """Whether an `Authorization` header carries `Bearer <token>` (always, without a token);
    compared in constant time."""
    if not token:
        return True
    if isinstance(authorization, str):
        authorization = authorization.encode("latin-1", "replace")
    return secrets.compare_digest(authorization, f"Bearer {token}".encode())


class RequestGuard:
    """ASGI middleware: authentication, then `Content-Length`, then the body under a deadline
    (see the module docstring). `token` '' lets every caller in."""

    def __init__(self, app, token: str, max_bytes: int, body_timeout_s: float):
        self.app, self.token = app, token
        self.max_bytes, self.body_timeout_s = max_bytes, body_timeout_s

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) == ("GET", "/health"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if not token_matches(headers.get(b"authorization", b""), self.token):
            return await _refuse(401, "missing or wrong bearer token", scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length", b"")
        if not length.isdigit() or b"transfer-encoding" in headers:
            reason = "a Content-Length header is required, without Transfer-Encoding"
            return await _refuse(411, reason, scope, receive, send)
        if int(length) > self.max_bytes:
            reason = f"body of {int(length)} bytes > {self.max_bytes}"
            return await _refuse(413, reason, scope, receive, send)
        try:
            body = await asyncio.wait_for(_read_body(receive, self.max_bytes), self.body_timeout_s)
        except TimeoutError:
            reason = f"the body did not arrive within {self.body_timeout_s} s"
            return await _refuse(408, reason, scope, receive, send)
        if body is None:
            return None  # the client went away
        if len(body) > self.max_bytes:
            reason = f"body of more than {self.max_bytes} bytes"
            return await _refuse(413, reason, scope, receive, send)
        return await self.app(scope, _replay(body, receive), send)


async def _read_body(receive, max_bytes: int) -> bytes | None:
    """The request body (None when the client disconnects first); reading stops as soon as
    it holds more than `max_bytes`, and what it holds then is returned."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > max_bytes or not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """An ASGI `receive` that gives `body` once, then waits on the client as before."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _refuse(status: int, reason: str, scope: Scope, receive, send) -> None:
    response = JSONResponse({"detail": reason}, status, headers={"Connection": "close"})
    await response(scope, receive, send)


def header_deadline_protocol(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol class, closing a connection whose next request's headers have not
    all arrived `header_timeout_s` seconds after it opened or after its last answer (pass it as
    `uvicorn.run(..., http=...)`)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._timer is not None:
                self._timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            waiting_for = self.cycle  # the request in progress when armed (None: the first)

            def late() -> None:  # no new request began and none is being answered
                idle = self.cycle is waiting_for and (
                    self.cycle is None or self.cycle.response_complete
                )
                if idle and not self.transport.is_closing():
                    self.transport.close()

            self._timer = self.loop.call_later(header_timeout_s, late)

    return HeaderDeadline
