"""A `colibri serve` server for tests: an app on a free loopback port, run by `app.server.http.Server` with the
configuration `colibri serve` uses (`build_config`), in a thread."""

from __future__ import annotations

import socket
import threading
import time

from app.server.http import HttpLimits, Server, build_config


def free_port() -> int:
    """A loopback port nobody listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`app` served on loopback under `limits` until `stop()`; `url` is its base URL."""

    def __init__(self, app, limits: HttpLimits = HttpLimits(), log_level: str = "warning"):
        self.port = free_port()
        self.server = Server(build_config(app, host="127.0.0.1", port=self.port, limits=limits, log_level=log_level))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=f"live-server-{self.port}")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def connections(self) -> int:
        """Connections uvicorn holds open now."""
        return len(self.server.server_state.connections)

    def stop(self) -> None:
        """Stop serving and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout=10)
