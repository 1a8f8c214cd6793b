"""`colibri serve` against hostile or careless clients (issue 29, failure 4 and the server's smaller ones): idle
half-open connections, slow heads and bodies, oversized heads, a full file table, JSON booleans posing as numbers,
parameters it cannot honour, and logit_bias, which it honours."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.commands import serve
from app.server.app import create_app
from app.server.http import HttpLimits, Throttle, ThrottleFilter, check_fd_limit
from app.service.local import EngineService, LoadOptions
from engine.errors import ColibriError, GenerationError
from engine.generation.sampling import LogitBias, SamplingParams, apply_processors, make_logits_processors
from support.live_server import LiveServer
from support.tiny_chat import CHARS

CTX = 256
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def app(container):
    service = EngineService(max_queue=2)
    service.load_and_wait(container, LoadOptions(context_length=CTX, max_batch=2))
    yield create_app(service)
    service.close()


@pytest.fixture(scope="module")
def server(app):
    """Short deadlines, few connections: what the tests below push against."""
    live = LiveServer(app, HttpLimits(max_connections=16, head_timeout=1.0, body_timeout=1.0, linger=1.0))
    yield live
    live.stop()


class Records(logging.Handler):
    """Counts what reaches the log (warnings and up) while a test runs."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def log_records():
    handler = Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "uvicorn.access", "asyncio")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.records
    for logger in loggers:
        logger.removeHandler(handler)


def _connect(live: LiveServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", live.port), timeout=10)
    return s


def _read_all(s: socket.socket, deadline: float = 10.0) -> bytes:
    """Everything the server sends until it closes (or the deadline passes: then the test fails)."""
    s.settimeout(deadline)
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def _error(answer: bytes) -> dict:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]


# --------------------------------------------------------------------------- connections and deadlines


def test_idle_half_header_connections_beyond_the_limit_cannot_lock_out_health(app, log_records):
    """20,200 idle half-header connections once exhausted every file descriptor; now the one that waited longest
    for its head makes room for each newcomer, so /health answers at once and the log stays quiet."""
    live = LiveServer(app, HttpLimits(max_connections=32, head_timeout=60.0))   # no deadline helps here
    flood = []
    try:
        for _ in range(400):
            s = _connect(live)
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: ")
            flood.append(s)
        t0 = time.monotonic()
        r = httpx.get(live.url + "/health", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert time.monotonic() - t0 < 5
        assert live.connections <= 32 + 1
        # the evicted ones were closed, not answered: nothing was asked on them (their unread bytes: a reset)
        try:
            assert _read_all(flood[0]) == b""
        except ConnectionResetError:
            pass
    finally:
        for s in flood:
            s.close()
        live.stop()
    assert len(log_records) <= 2, [r.getMessage() for r in log_records]


def test_a_busy_server_refuses_a_newcomer_with_503_and_recovers(app):
    """When every connection carries a request (slow bodies here), a newcomer gets 503 with Retry-After; the
    slow bodies time out and the server answers again."""
    live = LiveServer(app, HttpLimits(max_connections=4, head_timeout=5.0, body_timeout=1.5, linger=1.0))
    busy = []
    try:
        for _ in range(4):
            s = _connect(live)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 100\r\n\r\n{\"mo")
            busy.append(s)
        deadline = time.monotonic() + 5
        while True:     # the heads are parsed at the server's pace
            r = httpx.get(live.url + "/health", timeout=10)
            if r.status_code == 503 or time.monotonic() > deadline:
                break
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "retry shortly" in r.json()["error"]["message"]
        for s in busy:
            answer = _read_all(s)
            assert _status(answer) == 408 and "body did not arrive" in _error(answer)["message"]
        assert httpx.get(live.url + "/health", timeout=10).status_code == 200
    finally:
        for s in busy:
            s.close()
        live.stop()


def test_a_slow_head_is_answered_408_and_closed(server):
    s = _connect(server)
    t0 = time.monotonic()
    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
    answer = _read_all(s)
    assert _status(answer) == 408 and "head did not arrive within 1 s" in _error(answer)["message"]
    assert 0.8 < time.monotonic() - t0 < 5
    s.close()


def test_a_silent_connection_is_closed_after_the_head_deadline(server):
    s = _connect(server)
    t0 = time.monotonic()
    assert _read_all(s) == b""
    assert 0.8 < time.monotonic() - t0 < 5
    s.close()


def test_a_slow_body_is_answered_408_and_starts_no_generation(server, app):
    counters = app.state.served.counters
    before = counters.requests
    s = _connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: 60\r\n\r\n{\"model\": \"tiny\", \"prompt\": \"ab")
    answer = _read_all(s)
    assert _status(answer) == 408 and "body did not arrive within 1 s" in _error(answer)["message"]
    assert b"connection: close" in answer.lower()
    assert counters.requests == before
    s.close()
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_200kb_header_gets_431_not_a_reset(server):
    r = httpx.get(server.url + "/health", headers={"x-big": "a" * 200_000}, timeout=10)
    assert r.status_code == 431
    assert "over 16384 bytes" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_malformed_request_gets_400_in_the_error_shape(server):
    s = _connect(server)
    s.sendall(b"GARBAGE\r\n\r\n")
    answer = _read_all(s)
    assert _status(answer) == 400 and "malformed HTTP request" in _error(answer)["message"]
    s.close()


def test_a_full_file_table_is_logged_once_not_31_mb(tmp_path):
    """A server in a process that may open 64 files: a flood of connections runs accept() into EMFILE, which
    asyncio reports once per failed accept (up to the listen backlog per tick). The log gets it once; when the
    flood leaves, /health answers."""
    port = _free_port()
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "from app.server.http import HttpLimits, Server, build_config\n"
        "async def app(scope, receive, send):\n"
        "    if scope['type'] != 'http':\n"
        "        return\n"
        "    await send({'type': 'http.response.start', 'status': 200, 'headers': []})\n"
        "    await send({'type': 'http.response.body', 'body': b'ok'})\n"
        f"Server(build_config(app, port={port}, limits=HttpLimits(max_connections=5000, head_timeout=60))).run()\n"
    )
    log = tmp_path / "server.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stderr=err, stdout=err,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    flood: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"GET / HTTP/1.1\r\n")
            flood.append(s)
        deadline = time.monotonic() + 20
        while b"out of system resource" not in log.read_bytes():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        for s in flood:
            s.close()
        flood.clear()
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "/health never answered after the flood"
    finally:
        for s in flood:
            s.close()
        proc.terminate()
        proc.wait(timeout=10)
    text = log.read_text()
    assert text.count("out of system resource") <= 2, text[:3000]
    assert len(text) < 20_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_log_throttle_passes_one_record_per_kind_and_period():
    now = [0.0]
    throttle = Throttle(10.0, clock=lambda: now[0])
    assert throttle.admit("a") == 0 and throttle.admit("a") is None and throttle.admit("b") == 0
    for _ in range(1000):
        throttle.admit("a")
    now[0] = 10.5
    assert throttle.admit("a") == 1001
    f = ThrottleFilter()
    record = logging.LogRecord("uvicorn.error", logging.WARNING, "", 0, "Invalid HTTP request received.", (), None)
    assert f.filter(record) and not f.filter(record)


def test_the_connection_limit_fits_the_file_limit_or_says_how():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert check_fd_limit(64) >= 64
    if soft != resource.RLIM_INFINITY:
        with pytest.raises(ColibriError, match="ulimit -n"):
            check_fd_limit(10**9)
    assert serve.MAX_CONNECTIONS == HttpLimits().max_connections


def test_serve_refuses_a_connection_limit_below_its_queue():
    import argparse

    args = argparse.Namespace(port=8080, max_batch=4, max_queue=16, max_body=1 << 20, api_key=None,
                              max_connections=20)
    with pytest.raises(ColibriError, match="at least 21"):
        serve._check(args)


# --------------------------------------------------------------------------- bodies


def _post(live, path, body):
    # Generous: the first generation may compile the kernels into an empty numba cache.
    return httpx.post(live.url + path, json=body, timeout=600)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "tiny", "prompt": "ab", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": [False]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "ab", "seed": True}, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "ab", "temperature": True}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "ab", "stream": 1}, "stream"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": True}, "n"),
])
def test_json_booleans_are_not_numbers(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param


def test_an_integer_is_still_a_float(server):
    # The random model may sample its end token first, so the count is at most 2, not exactly 2.
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "ab", "temperature": 1, "top_p": 1,
                                          "max_tokens": 2, "presence_penalty": 0, "seed": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert r.json()["usage"]["completion_tokens"] <= 2


MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),     # the tiny template writes no tool calls
    ("functions", [{"name": "f"}]), ("modalities", ["text", "audio"]), ("audio", {"voice": "x"}),
    ("web_search_options", {}), ("reasoning_effort", "high"),
])
def test_openai_fields_it_cannot_honour_are_refused_by_name(server, field, value):
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "Colibri does not implement it" in err["message"]


@pytest.mark.parametrize("field, value", [("echo", True), ("suffix", "end"), ("best_of", 3)])
def test_completion_fields_it_cannot_honour_are_refused_by_name(server, field, value):
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "ab", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_fields_that_ask_for_nothing_are_accepted(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi", "name": "ann"}], "max_tokens": 2,
            "user": "u-1", "metadata": {"k": "v"}, "store": False, "logprobs": False, "tools": [],
            "tool_choice": "none", "response_format": {"type": "text"}, "parallel_tool_calls": False,
            "service_tier": "auto", "top_logprobs": 0, "modalities": ["text"], "something_else": 1}
    assert _post(server, "/v1/chat/completions", body).status_code == 200
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "ab", "max_tokens": 2, "echo": False,
                                          "best_of": 1, "suffix": None})
    assert r.status_code == 200


def _greedy(server, **extra):
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0,
                                          **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_logit_bias_is_honoured(server):
    plain = _greedy(server)
    wanted = "Z" if plain[0] != "Z" else "Q"
    token = CHARS.index(wanted) + 1            # the character tokenizer: id i + 1 is CHARS[i]
    assert _greedy(server, logit_bias={str(token): 100}) == wanted * 4
    banned = CHARS.index(plain[0]) + 1
    assert _greedy(server, logit_bias={str(banned): -100})[0] != plain[0]
    assert _greedy(server, logit_bias={}) == plain


@pytest.mark.parametrize("bias, words", [({"99999": 5}, "outside the vocabulary"), ({"3": 101}, "logit_bias"),
                                         ({"x": 1}, "logit_bias"), ({"3": True}, "logit_bias")])
def test_bad_logit_bias_gets_400(server, bias, words):
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "ab", "logit_bias": bias})
    assert r.status_code == 400 and words in r.json()["error"]["message"] + str(r.json()["error"]["param"]), r.text


def test_logit_bias_processor_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32)
    params = SamplingParams(logit_bias=((3, 5.0), (7, -100.0), (3, 2.5)), repetition_penalty=1.5)
    procs = make_logits_processors(params)
    assert isinstance(procs[0], LogitBias)            # first in the chain, before the penalties
    got = LogitBias(params.logit_bias)(logits, ())
    want = logits.copy()
    want[3] += 2.5                                    # a repeated id: the last amount counts, as in a JSON object
    want[7] += -100.0
    np.testing.assert_array_equal(got, want)
    assert apply_processors(logits, [], procs[:1]) is not logits
    with pytest.raises(GenerationError, match="vocabulary"):
        LogitBias(((50, 1.0),))(logits, ())
    for bad in [((1, 101.0),), ((-1, 1.0),), ((True, 1.0),), ((1, float("nan")),), ((1,),)]:
        with pytest.raises(GenerationError, match="logit_bias"):
            SamplingParams(logit_bias=bad).validate()
    # a saved session gives JSON lists: they come back as hashable pairs
    assert SamplingParams(logit_bias=[[3, 5.0]]).logit_bias == ((3, 5.0),)
    hash(SamplingParams(logit_bias=[[3, 5.0]]))


def test_the_atlas_404_does_not_show_the_model_path(server, container):
    r = httpx.get(server.url + "/v1/atlas")
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert "colibri atlas" in message and str(container) not in message and "/" not in message.split("`")[0]
