"""A FastAPI app served on a free local port in a background thread, for HTTP client tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import uvicorn


def serve(app) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 at a free port; yields `http://127.0.0.1:<port>`, stops after."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)
