"""A real radixkv server for tests: uvicorn on 127.0.0.1 and a free port, in a thread, stopped after."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from radixkv.serve import build, parser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, alive=lambda: True, seconds: float = 90) -> None:
    """Until ``GET /health`` answers 200 (AssertionError after ``seconds`` or once ``alive()`` is false)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and alive(), "the server did not start"
        time.sleep(0.05)


@contextmanager
def running_server(*argv: str):
    """``radixkv serve`` with these arguments, served from a thread; yields ``(base_url, app)``."""
    port = free_port()
    args = parser().parse_args([*argv, "--port", str(port)])
    app, engine = build(args)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, alive=thread.is_alive)
    try:
        yield base, app
    finally:
        engine.abort_all()
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not stop"
