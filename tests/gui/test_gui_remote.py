"""The desktop app on a Colibri server on another machine (here: a live uvicorn server on loopback):
the server-sent events parser, RemoteService against the server (chat equal to the server's own
answer, Stop, telemetry snapshots and tiers, a stream that drops and comes back), and the main window
on it (chat, inspector, the local-only controls disabled with the reason, a wrong key and a dead
port as clear messages with the app still up)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn

from app.service.local import (
    TIER_DISK,
    TIER_NONE,
    EngineService,
    GenerateRequest,
    Generation,
    LoadFailed,
    LoadOptions,
    ModelLoaded,
    SettingsApplied,
    SettingsChange,
)
from app.service.remote import ConnectionChanged, RemoteService
from app.service.wire import Endpoint, SSEEvent, SSEParser, completion_body, iter_sse
from engine.events import DoneEvent, ErrorEvent, TokenEvent
from engine.generation.sampling import SamplingParams
from engine.telemetry import Snapshot
from support.qt import *  # noqa: F403 - the GUI fixtures (no_leftovers is autouse)
from support.qt import EVENT_TIMEOUT_MS, LOAD_TIMEOUT_MS, qtbot_app, test_settings
from support.server import paced

KEY = "remote-test-key-0123"
CTX = 256
MESSAGES = [{"role": "user", "content": "hello there"}]


# ---- the server-sent events parser ----------------------------------------------------------------


def test_sse_data_lines_join_and_a_blank_line_ends_the_event():
    lines = ["data: {\"a\": 1}\n", "\n", "data: first\n", "data:second\n", "data:  two spaces\n", "\n",
             "data: [DONE]\n", "\n"]
    assert list(iter_sse(lines)) == [SSEEvent('{"a": 1}'), SSEEvent("first\nsecond\n two spaces"),
                                     SSEEvent("[DONE]")]


def test_sse_comments_event_names_ids_crlf_and_bytes():
    parser = SSEParser()
    lines = [b": keep-alive\r\n", b"\r\n", b"event: tick\r\n", b"id: 7\r\n", b"retry: 100\r\n",
             "data: é\r\n".encode(), b"\r\n", b"data\n", b"\n", b"event: lonely\n", b"\n", b"data: x\n", b"\n"]
    events = list(iter_sse(lines, parser))
    assert events == [SSEEvent("é", "tick", "7"), SSEEvent("", "message", "7"), SSEEvent("x", "message", "7")]
    assert parser.comments == 1      # a keep-alive is no event; an event type without data dispatches nothing


def test_sse_an_event_cut_off_by_the_end_of_the_stream_is_dropped():
    assert list(iter_sse(["data: whole\n", "\n", "data: cut"])) == [SSEEvent("whole")]
    parser = SSEParser()
    assert parser.feed("data: a") is None and parser.feed("") == SSEEvent("a")    # line endings are optional


def test_server_addresses_and_completion_bodies():
    assert Endpoint.parse("10.0.0.2").url == "http://10.0.0.2:8080"                 # colibri serve's port
    assert Endpoint.parse("http://box:9000/v1/").url == "http://box:9000"
    assert Endpoint.parse("https://box/colibri/v1") == Endpoint("https", "box", 443, "/colibri")
    assert Endpoint.parse("http://[::1]:81").url == "http://[::1]:81"
    for bad in ("ftp://box", "http://", "http://box:99999"):
        with pytest.raises(Exception, match="--remote"):
            Endpoint.parse(bad)
    req = GenerateRequest(1, None, (), SamplingParams(temperature=0.5, top_p=0.9, seed=3, repetition_penalty=1.1),
                          40, ("\n\n",))
    body = completion_body(req, "tiny")
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["messages"] == []
    assert (body["temperature"], body["top_p"], body["seed"], body["max_tokens"], body["stop"]) == (
        0.5, 0.9, 3, 40, ["\n\n"])


# ---- a live server ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """A uvicorn server on a loopback port, in a thread (open streams are cut at stop)."""

    def __init__(self, app, port: int | None = None):
        self.port = port or free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def served(models):
    """The tiny chat MoE container (its experts stream) in an engine service, as `colibri serve` runs it."""
    container = models[1]
    service = EngineService(max_queue=4, name="test-serve-engine")
    service.load_and_wait(str(container), LoadOptions(context_length=CTX, max_batch=2))
    yield service
    service.close()


@pytest.fixture(scope="module")
def server(served):
    from app.server.app import create_app

    live = Live(create_app(served, api_key=KEY))
    # the first decode starts the engine's own threads (its streamed model's read-ahead): before the tests, which
    # check that they leave none behind; on an empty Numba cache it also compiles the kernels, so it may take minutes
    whole_answer(live, MESSAGES, 2, timeout=900)
    yield live
    live.stop()


def whole_answer(server, messages, max_tokens: int, repetition_penalty: float = 1.0, timeout: float = 60) -> str:
    """The server's own, non-streamed, greedy answer."""
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=timeout,
                   json={"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                         "repetition_penalty": repetition_penalty})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


class Events:
    """A RemoteService listener that keeps every event; wait(pred) blocks until one matches."""

    def __init__(self):
        self.items: list = []
        self.cond = threading.Condition()

    def __call__(self, event) -> None:
        with self.cond:
            self.items.append(event)
            self.cond.notify_all()

    def wait(self, pred, timeout: float = LOAD_TIMEOUT_MS / 1000):   # a first load compiles kernels on a cold cache
        with self.cond:
            assert self.cond.wait_for(lambda: any(pred(e) for e in self.items), timeout), self.items[-5:]
            return next(e for e in self.items if pred(e))

    def generation(self, request: int) -> list:
        return [e.event for e in self.items if isinstance(e, Generation) and e.request == request]


def done_of(request: int):
    return lambda e: isinstance(e, Generation) and e.request == request and isinstance(e.event, (DoneEvent,
                                                                                                  ErrorEvent))


def load_failed(request: int):
    return lambda e: isinstance(e, LoadFailed) and e.request == request


# ---- the remote service --------------------------------------------------------------------------


def test_remote_chat_streams_the_servers_answer_and_settings_are_refused(server, served):
    events = Events()
    with RemoteService(server.url, KEY, on_event=events) as remote:
        request = remote.load()
        loaded = events.wait(lambda e: isinstance(e, ModelLoaded) and e.request == request)
        info, here = loaded.info, served.info
        assert (info.name, info.architecture, info.n_layers, info.n_experts, info.top_k, info.chat) == (
            here.name, here.architecture, here.n_layers, here.n_experts, here.top_k, here.chat)
        assert info.settings == here.settings and info.budget_range == here.budget_range and info.streaming == "experts"
        assert remote.info is info and set(info.fixed) == {"memory_budget", "prefetch_depth", "io_threads",
                                                           "context_length"}
        want = whole_answer(server, MESSAGES, 16)
        request = remote.generate(messages=MESSAGES, sampling=SamplingParams(), max_tokens=16)
        events.wait(done_of(request))
        *tokens, done = events.generation(request)
        assert all(isinstance(t, TokenEvent) for t in tokens) and len(tokens) > 1
        assert "".join(t.text for t in tokens) == want == done.text
        assert done.finish_reason == "length" and len(done.tokens) == 16 and done.stats.ttft_s > 0
        assert done.stats.prompt_tokens > 0 and done.stats.decode_tok_s > 0
        # settings and the atlas are the server's: refused at once, saying where they are set
        request = remote.update_settings(SettingsChange(memory_budget=1 << 20))
        applied = events.wait(lambda e: isinstance(e, SettingsApplied) and e.request == request)
        assert applied.info is info and server.url in applied.problems[0] and "colibri serve" in applied.problems[0]
        assert served.info.settings == here.settings
    assert not remote.running


def test_stop_closes_the_stream_and_the_server_stops_generating(server, served, monkeypatch):
    paced(monkeypatch, 0.01)  # the answer cannot run to its end before the server sees us leave
    events = Events()
    with RemoteService(server.url, KEY, on_event=events) as remote:
        # more tokens than the context has room for: the server refuses max_tokens, the answer runs to the end
        request = remote.generate(messages=MESSAGES, max_tokens=CTX)
        events.wait(lambda e: isinstance(e, Generation) and e.request == request and isinstance(e.event, TokenEvent))
        t0 = time.monotonic()
        remote.cancel(request)
        done = events.wait(done_of(request), timeout=10).event
        assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled" and time.monotonic() - t0 < 5
        assert 0 < len(done.text) and len(done.tokens) < CTX - 20
    deadline = time.monotonic() + 10
    while served.batch and time.monotonic() < deadline:    # the server saw the client leave and ended it
        time.sleep(0.05)
    assert served.batch == 0


def test_telemetry_snapshots_and_tiers_arrive_with_the_records_kept(server):
    events = Events()
    snaps, grids = [], []
    with RemoteService(server.url, KEY, on_event=events, telemetry_interval=0.05) as remote:
        sub = remote.subscribe(snaps.append)
        tiers = remote.subscribe_tiers(grids.append)
        events.wait(lambda e: isinstance(e, ConnectionChanged) and e.connected)
        request = remote.generate(messages=MESSAGES, max_tokens=60)
        events.wait(done_of(request))
        deadline = time.monotonic() + 10
        while not (snaps and snaps[-1].tokens >= 60 and grids) and time.monotonic() < deadline:
            time.sleep(0.05)
        snap = snaps[-1]
        assert isinstance(snap, Snapshot) and snap.tokens >= 60 and snap is remote.snapshot()
        assert snap.heat.shape == (3, 8) and snap.heat.dtype == np.float32 and snap.heat.sum() > 0
        assert not snap.heat.flags.writeable and snap.current and snap.hits["disk"] + snap.hits["cached"] > 0
        assert len(snap.recent) > 32       # each event carries 32 records; the service keeps them across events
        grid = grids[-1]
        assert grid.shape == (3, 8) and grid.dtype == np.int8 and not grid.flags.writeable
        assert set(np.unique(grid).tolist()) <= {TIER_NONE, TIER_DISK, 1, 2, 3} and (grid >= TIER_DISK).all()
        per_event = remote.bytes_received / remote.events_received
        assert per_event < 20_000, per_event
        sub.close()
        tiers.close()
        n, g = len(snaps), len(grids)
        # closed: nothing more, while a subscription still open keeps receiving the next answer's telemetry
        later: list[Snapshot] = []
        with remote.subscribe(later.append):
            events.wait(done_of(remote.generate(messages=MESSAGES, max_tokens=20)))
            deadline = time.monotonic() + 10
            while not (later and later[-1].tokens > snap.tokens) and time.monotonic() < deadline:
                time.sleep(0.05)
        assert later and later[-1].tokens > snap.tokens
        assert len(snaps) == n and len(grids) == g


def test_the_telemetry_stream_reconnects_when_the_server_comes_back(served):
    from app.server.app import create_app

    first = Live(create_app(served, api_key=KEY))
    events = Events()
    with RemoteService(first.url, KEY, on_event=events, telemetry_interval=0.05) as remote:
        remote.subscribe(lambda snap: None)
        events.wait(lambda e: isinstance(e, ConnectionChanged) and e.connected)
        first.stop()
        lost = events.wait(lambda e: isinstance(e, ConnectionChanged) and not e.connected, timeout=20)
        assert first.url in lost.message and "retrying" in lost.message
        again = Live(create_app(served, api_key=KEY), port=first.port)
        try:
            with events.cond:
                assert events.cond.wait_for(lambda: [e.connected for e in events.items
                                                     if isinstance(e, ConnectionChanged)] == [True, False, True], 20)
        finally:
            remote.close()
            again.stop()


def test_a_wrong_key_and_a_dead_port_are_clear_messages(server):
    events = Events()
    with RemoteService(server.url, "not-the-key", on_event=events) as remote:
        failed = events.wait(load_failed(remote.load()))
        assert "refused the API key" in failed.message and server.url in failed.message
        request = remote.generate(messages=MESSAGES, max_tokens=4)
        error = events.wait(done_of(request)).event
        assert isinstance(error, ErrorEvent) and "--api-key" in error.message
    port = free_port()
    with RemoteService(f"127.0.0.1:{port}", on_event=(events := Events())) as remote:
        failed = events.wait(load_failed(remote.load()))
        assert f"http://127.0.0.1:{port}" in failed.message and "colibri serve" in failed.message
    with RemoteService(server.url, on_event=(events := Events())) as remote:     # no key at all
        failed = events.wait(load_failed(remote.load()))
        assert "needs an API key" in failed.message and f"--remote {server.url} --api-key" in failed.message


# ---- the main window on a server -------------------------------------------------------------------


@pytest.fixture
def remote_window(qtbot, tmp_path):
    """remote_window(url, key) -> a shown MainWindow on the server at url; every one is closed at teardown."""

    from app.conversations import ConversationStore
    from ui.app import MainWindow, configure
    from ui.startup import remote_service

    configure(qtbot_app())
    made = []

    def make(url: str, key: str | None):
        w = MainWindow(test_settings(tmp_path / "colibri.ini"),     # greedy: the server's answer is known
                       ConversationStore(tmp_path / "conversations"), service=remote_service(url, key))
        made.append(w)
        w.show()
        qtbot.waitExposed(w)
        return w

    yield make
    for w in made:
        w.close()
        w.deleteLater()


def test_the_window_chats_through_the_server_and_its_inspector_watches_it(qtbot, remote_window, server):
    window = remote_window(server.url, KEY)
    try:
        with qtbot.waitSignal(window.bridge.modelLoaded, timeout=LOAD_TIMEOUT_MS):
            window.open_model(server.url)
        info = window.info
        assert server.url in window.model_label.text() and info.name in window.windowTitle()
        # what only makes sense here is disabled, saying why
        for action in (window.models.open_folder, window.models.open_gguf, window.models.convert, window.get_model):
            assert not action.isEnabled() and server.url in action.toolTip()
        for setting in window.controls.settings():
            assert not setting.slider.isEnabled() and "colibri serve" in setting.slider.toolTip()
        assert server.url in window.controls.note.text()
        atlas_button = window.inspector.atlas.compute_button
        assert not atlas_button.isEnabled() and "colibri atlas" in atlas_button.toolTip()
        assert window.show_first_run() is None
        # chat: the answer is the server's
        penalty = window.chat.conversation.sampling.repetition_penalty    # the chat's default (1.1) reaches the server
        want = whole_answer(server, [{"role": "user", "content": "Tell me about experts"}], 24, penalty)
        window.chat.max_tokens.setValue(24)
        done = []
        window.bridge.generation.connect(lambda r, e: isinstance(e, DoneEvent) and done.append(e))
        assert window.chat.send("Tell me about experts")
        qtbot.waitUntil(lambda: bool(done), timeout=60_000)
        assert done[0].text == want and window.chat.conversation.turns[-1].content == want
        assert "24 tokens" in window.chat.status.text()
        # the inspector got the server's telemetry: snapshots with heat, and tiers
        inspector = window.inspector
        qtbot.waitUntil(lambda: inspector._snapshot is not None and inspector._snapshot.tokens > 0
                        and inspector._tiers is not None, timeout=20_000)
        assert inspector._tiers.shape == (info.n_layers, info.n_experts)
        assert inspector._snapshot.heat.shape == (info.n_layers, info.n_experts)
        qtbot.waitUntil(lambda: inspector.redraws > 0, timeout=EVENT_TIMEOUT_MS)
        assert "live" in window.connection_label.text()
        # Stop in the window ends the answer
        window.chat.new_conversation()
        window.chat.max_tokens.setValue(200)
        tokens = []
        window.bridge.generation.connect(lambda r, e: isinstance(e, TokenEvent) and tokens.append(e))
        assert window.chat.send("A long answer please")
        qtbot.waitUntil(lambda: bool(tokens), timeout=30_000)
        window.chat.stop()
        qtbot.waitUntil(lambda: not window.chat.generating, timeout=EVENT_TIMEOUT_MS)
        assert "Stopped" in window.chat.status.text()
    finally:
        window.close()
    assert window.bridge.closed and not window.bridge.service.running


def test_a_wrong_key_or_a_dead_port_shows_a_clear_error_and_the_window_stays_up(qtbot, remote_window, server):
    window = remote_window(server.url, "wrong-key-0000")
    try:
        with qtbot.waitSignal(window.bridge.loadFailed, timeout=30_000):
            window.open_model(server.url)
        box = window.error_dialog
        assert box is not None and box.isVisible() and "refused the API key" in box.text() and server.url in box.text()
        assert window.isVisible() and window.info is None and not window.chat.send_button.isEnabled()
        qtbot.waitUntil(lambda: "refused the API key" in window.connection_label.text(), timeout=20_000)
        box.accept()
    finally:
        window.close()
    port = free_port()
    window = remote_window(f"http://127.0.0.1:{port}", None)
    try:
        with qtbot.waitSignal(window.bridge.loadFailed, timeout=30_000):
            window.open_model(window.remote.url)
        text = window.error_dialog.text()
        assert f"127.0.0.1:{port}" in text and "colibri serve" in text and window.isVisible()
        assert "Not connected" in window.model_label.text()
    finally:
        window.close()
