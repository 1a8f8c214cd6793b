"""`colibri gui MODEL --self-test PROMPT`: the real window loads MODEL, sends PROMPT through the chat,
prints what happened and when as one JSON line on stdout, and quits.

The packaged app's check (tests/packaging/test_package.py) uses it: nothing else exercises the bundle
end to end without a person at the window. Times are seconds since the process started.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

from PySide6.QtCore import QObject, QTimer
from PySide6.QtWidgets import QApplication

from engine.events import DoneEvent, ErrorEvent, TokenEvent

_IMPORTED = time.monotonic()


def process_age() -> float:
    """Seconds since this process started (from /proc on Linux; elsewhere since this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22: starttime, in clock ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


@dataclass(frozen=True)
class SelfTest:
    """What to check: the prompt, the answer's length in tokens, and how long to wait before giving up."""

    prompt: str
    max_tokens: int = 8
    timeout_s: float = 600.0


class SelfTestRun(QObject):
    """Drives a shown MainWindow through load -> send -> answer, then prints the report and closes it."""

    def __init__(self, window, spec: SelfTest):
        super().__init__(window)
        self.window, self.spec = window, spec
        self.exit_code = 1          # until the answer arrives
        self.times: dict[str, float] = {}
        self.report: dict | None = None
        self._request: int | None = None
        window.bridge.modelLoaded.connect(self._loaded)     # after the window's own handler: the chat is ready
        window.bridge.loadFailed.connect(self._load_failed)
        window.bridge.generation.connect(self._generation)
        self._timeout = QTimer(self)
        self._timeout.setSingleShot(True)
        self._timeout.timeout.connect(lambda: self._finish(2, {"error": f"no answer within {spec.timeout_s:.0f} s"}))
        self._timeout.start(int(spec.timeout_s * 1000))
        QTimer.singleShot(0, lambda: self._mark("window_shown_s"))  # once the event loop has shown the window

    def _mark(self, key: str) -> None:
        self.times.setdefault(key, round(process_age(), 3))

    def _loaded(self, event) -> None:
        if self._request is not None or self.report is not None:   # only the first model counts
            return
        self._mark("model_loaded_s")
        chat = self.window.chat
        chat.temperature.setValue(0.0)
        chat.max_tokens.setValue(self.spec.max_tokens)
        if not chat.send(self.spec.prompt):
            self._finish(1, {"error": f"{event.info.name} cannot chat (no chat template?)"})
            return
        self._request = chat._request

    def _load_failed(self, event) -> None:
        self._finish(1, {"error": f"the model did not load: {event.message}"})

    def _generation(self, request: int, event: object) -> None:
        if request != self._request:
            return
        if isinstance(event, TokenEvent):
            self._mark("first_token_s")
        elif isinstance(event, DoneEvent):
            self._mark("done_s")
            ok = len(event.tokens) > 0 and event.finish_reason in ("length", "stop")
            self._finish(0 if ok else 1, {"tokens": len(event.tokens), "text": event.text,
                                          "finish_reason": event.finish_reason,
                                          "ttft_s": round(event.stats.ttft_s, 4),
                                          "decode_tok_s": round(event.stats.decode_tok_s, 2)})
        elif isinstance(event, ErrorEvent):
            self._finish(1, {"error": event.message})

    def _finish(self, code: int, fields: dict) -> None:
        if self.report is not None:
            return
        self._timeout.stop()
        self.exit_code = code
        self.report = {"ok": code == 0, **self.times, **fields, "frozen": bool(getattr(sys, "frozen", False)),
                       "numba_cache_dir": os.environ.get("NUMBA_CACHE_DIR")}
        print(json.dumps(self.report), flush=True)
        self.window.close()
        QApplication.instance().exit(code)
