"""A live `colibri serve` on loopback for tests that need real sockets: the server in a thread, its /metrics
read as numbers, requests sent by hand on raw sockets (so a test can leave mid-request), and waiting on a
condition with a deadline."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import httpx

from support.live_server import LiveServer


class Live(LiveServer):
    """A server of `app` on a free loopback port, in a thread, configured as `colibri serve` runs it."""

    def __init__(self, app):
        super().__init__(app, log_level="critical")


def serve(container, *, ctx: int, max_batch: int, max_queue: int, speculative: bool = False, **app_kw) -> Live:
    """A live server of `container` on its own engine service; `live.service` and `live.served` reach inside."""
    from app.server.app import create_app
    from app.service.local import EngineService, LoadOptions

    service = EngineService(max_queue=max_queue)
    try:
        service.load_and_wait(container, LoadOptions(context_length=ctx, max_batch=max_batch,
                                                          speculative=speculative))
        app = create_app(service, **app_kw)
        live = Live(app)
    except BaseException:
        service.close()
        raise
    live.service, live.served = service, app.state.served
    return live


def wait_until(condition: Callable[[], object], seconds: float, what: str) -> None:
    """Poll `condition` until it holds; fail with `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} (after {seconds} s)")
        time.sleep(0.02)


def metrics(url: str, key: str | None = None) -> dict[str, float]:
    """The server's /metrics as {name without `colibri_`: value}."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("colibri_"):
            name, value = line.split()
            out[name[len("colibri_"):]] = float(value)
    return out


def open_request(port: int, path: str, body: dict, key: str | None = None) -> socket.socket:
    """Send a JSON POST on a raw socket and return the socket unread: closing it is a client that leaves."""
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(data)}\r\n\r\n")
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head.encode() + data)
    return sock


def raw_answer(port: int, data: bytes, deadline: float = 10.0) -> tuple[int, dict]:
    """Send `data` on a new connection and read until the server closes it: (status, JSON body). For the answers
    written below the app (408, 431, 503), which close the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=deadline) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    head, body = out.split(b"\r\n\r\n", 1)
    return int(head.split(b" ", 2)[1]), json.loads(body)
