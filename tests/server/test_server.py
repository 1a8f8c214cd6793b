"""`colibri serve`: the official OpenAI client against a live server on loopback, errors in OpenAI's
shape (never a 500), authentication, the queue, disconnects freeing KV blocks, and fuzzing."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.server.app import create_app
from app.service.local import EngineService, LoadOptions
from engine.generation.generate import GenerationRequest, stream_generate
from engine.generation.sampling import SamplingParams
from engine.kv import KVCache
from support.server import paced

KEY = "test-key-0123456789"
CTX = 256


class Live:
    """A uvicorn server on a free loopback port, in a thread."""

    def __init__(self, app):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _serve(container, max_batch, max_queue, **app_kw) -> Live:
    """A live server on the engine service (the one the desktop app drives), streaming the container's experts."""
    service = EngineService(max_queue=max_queue)
    service.load_and_wait(container, LoadOptions(context_length=CTX, max_batch=max_batch))
    app = create_app(service, **app_kw)
    live = Live(app)
    live.service, live.served = service, app.state.served
    return live


@pytest.fixture(scope="module")
def server(container):
    live = _serve(container, 2, 2, api_key=KEY, max_body=64 * 1024)
    yield live
    live.stop()
    live.service.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _direct(model, messages, max_tokens, sampling=SamplingParams()):
    prompt = model.tokenizer.encode_chat(messages, add_generation_prompt=True)
    req = GenerationRequest(prompt=tuple(prompt), max_tokens=max_tokens, sampling=sampling)
    return list(stream_generate(model.model, model.tokenizer, req, stop_ids=model.stop_ids,
                                cache=KVCache(model.spec, CTX)))[-1]


MESSAGES = [{"role": "user", "content": "hello there"}]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"   # no key needed


def test_chat_completion_equals_the_engine(model, client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    want = _direct(model, MESSAGES, 12)
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(
        model.tokenizer.encode_chat(MESSAGES, add_generation_prompt=True))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_streamed_chat_adds_up_and_reports_usage(model, client):
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _direct(model, MESSAGES, 10).text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_completions_with_stop_seed_and_penalties(model, client):
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=0.8, seed=5, top_p=0.9,
                                  presence_penalty=0.5, frequency_penalty=0.2)
    again = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=0.8, seed=5, top_p=0.9,
                                      presence_penalty=0.5, frequency_penalty=0.2)
    assert r.choices[0].text == again.choices[0].text and r.usage.completion_tokens == 8
    full = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0).choices[0].text
    stop = full[5:7]
    cut = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[: full.index(stop)]
    streamed = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=0, stream=True)
    assert len("".join(c.choices[0].text for c in streamed)) >= 1


def test_the_repetition_penalty_of_the_desktop_app_is_honoured(model, client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                       extra_body={"repetition_penalty": 1.3})
    want = _direct(model, MESSAGES, 12, SamplingParams(repetition_penalty=1.3))
    assert r.choices[0].message.content == want.text != _direct(model, MESSAGES, 12).text


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(model, client, server):
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]
    out = [None] * 3

    def ask(i):
        out[i] = client.chat.completions.create(model="tiny", messages=prompts[i], max_tokens=16, temperature=0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(3):
        assert out[i].choices[0].message.content == _direct(model, prompts[i], 16).text
    assert server.service.kv_usage()[1] == 0


def _post(server, path, body, key=KEY, raw=False):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if raw:
        return httpx.post(server.url + path, content=body, headers={**headers, "content-type": "application/json"})
    return httpx.post(server.url + path, json=body, headers=headers)


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"model": "tiny", "messages": "hi"}).encode(), 400, "messages"),
    (json.dumps({"model": "tiny", "messages": MESSAGES, "temperature": 9}).encode(), 400, "temperature"),
    (json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": "many"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "gpt-9", "messages": MESSAGES}).encode(), 404, "not served here"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 400}]}).encode(), 400,
     "tokens but the context holds 256"),
    (json.dumps({"model": "tiny", "messages": MESSAGES, "n": 3}).encode(), 400, "n"),
    (b"[]", 400, ""),
])
def test_bad_requests_get_openai_shaped_4xx(server, body, status, words):
    r = _post(server, "/v1/chat/completions", body, raw=True)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_keys_sizes_and_cors(server):
    assert _post(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES}, key=None).status_code == 401
    assert _post(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES}, key="wrong-key-00000").status_code == 401
    assert httpx.get(server.url + "/v1/models").status_code == 401
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 70000}]}
    r = _post(server, "/v1/chat/completions", big)
    assert r.status_code == 413 and "over 65536 bytes" in r.json()["error"]["message"]

    def chunked():          # no Content-Length: the limit is found while the body arrives
        yield json.dumps(big).encode()

    r = httpx.post(server.url + "/v1/chat/completions", content=chunked(),
                   headers={"authorization": "Bearer " + KEY, "content-type": "application/json"})
    assert r.status_code == 413 and "over 65536 bytes" in r.json()["error"]["message"]
    r = httpx.options(server.url + "/v1/models", headers={"origin": "http://evil.example",
                                                         "access-control-request-method": "GET"})
    assert "access-control-allow-origin" not in r.headers


def test_metrics_and_telemetry_stream(server, client):
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    text = httpx.get(server.url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    for name in ("colibri_generated_tokens_total", "colibri_queue_depth", "colibri_tokens_per_second",
                 "colibri_expert_hit_rate", "colibri_bytes_read_total", "colibri_rss_bytes"):
        assert name in text
    with httpx.stream("GET", server.url + "/v1/telemetry?interval=0.1", headers={"authorization": f"Bearer {KEY}"},
                      timeout=30) as r:
        line = next(line for line in r.iter_lines() if line.startswith("data: "))
    snap = json.loads(line[6:])
    assert {"tokens", "tok_per_s", "heat", "occupancy", "hits"} <= set(snap) and "tiers" not in snap
    assert snap["tokens"] >= 4 and np.asarray(snap["heat"]).shape == (3, 8)


def test_what_a_remote_desktop_app_reads(server, client, model):
    auth = {"authorization": f"Bearer {KEY}"}
    info = httpx.get(server.url + "/v1/models", headers=auth).json()["data"][0]["colibri"]
    assert (info["name"], info["n_layers"], info["n_experts"], info["chat"]) == ("tiny", 3, 8, True)
    assert info["streaming"] == "experts" and info["settings"]["context_length"] == CTX
    least, every = info["budget_range"]
    assert 0 < least < every and info["settings"]["memory_budget"] <= every
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    with httpx.stream("GET", server.url + "/v1/telemetry?interval=0.1&recent=2&tiers=1", headers=auth,
                      timeout=30) as r:
        line = next(line for line in r.iter_lines() if line.startswith("data: "))
    snap = json.loads(line[6:])
    tiers = np.asarray(snap["tiers"])
    assert tiers.shape == (3, 8) and set(np.unique(tiers)) <= {0, 1, 2}    # on disk, cached or pinned
    assert (tiers > 0).any() and len(snap["recent"]) <= 2                 # what the last answer read is held
    r = httpx.get(server.url + "/v1/atlas", headers=auth)
    assert r.status_code == 404 and "colibri atlas" in r.json()["error"]["message"]


def test_a_client_that_leaves_cancels_and_frees_its_blocks(server, monkeypatch):
    paced(monkeypatch)
    counters = server.served.counters
    cancelled = counters.cancelled
    # greedy, so no end-of-sequence token comes early: 200 tokens at 20 ms a step outlast the client
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers={"authorization": f"Bearer {KEY}"}, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    deadline = time.monotonic() + 20
    while (counters.cancelled == cancelled or server.service.kv_usage()[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counters.cancelled > cancelled and server.service.kv_usage()[1] == 0


def test_a_full_queue_answers_429_with_retry_after(container, monkeypatch):
    live = _serve(container, 1, 0)       # one running, none waiting
    paced(monkeypatch)
    try:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "stream": True, "temperature": 0}
        with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)                                   # the first request is in the batch now
            refused = httpx.post(live.url + "/v1/chat/completions", json={**body, "stream": False})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
        assert "retry shortly" in refused.json()["error"]["message"]
        assert live.served.counters.rejected == 1
    finally:
        live.stop()
        live.service.close()


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                    max_leaves=12)
FIELDS = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["tiny", "other"]) | JSON,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot"]) | JSON,
                                                "content": st.text(max_size=30) | JSON}), max_size=3) | JSON,
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 500), max_size=5) | JSON,
    "temperature": st.floats(-1, 3) | JSON, "top_p": st.floats(-1, 2) | JSON,
    "max_tokens": st.integers(-3, 5) | JSON, "stop": st.text(max_size=4) | JSON, "seed": st.integers(-3, 2**70) | JSON,
    "stream": st.booleans() | JSON, "n": st.integers(0, 3) | JSON,
    "presence_penalty": st.floats(-3, 3) | JSON, "stream_options": JSON,
    # Anthropic's and Ollama's own
    "system": st.text(max_size=10) | JSON, "stop_sequences": st.lists(st.text(max_size=3), max_size=3) | JSON,
    "top_k": st.integers(-2, 50) | JSON, "raw": st.booleans() | JSON, "context": st.lists(st.integers(-5, 500)) | JSON,
    "options": st.fixed_dictionaries({}, optional={"temperature": st.floats(-1, 3) | JSON, "num_predict": st.integers(
        -3, 5) | JSON, "stop": JSON, "seed": st.integers(-3, 2**70) | JSON, "repeat_last_n": st.integers(-2, 70)}) | JSON,
})
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/api/chat",
          "/api/generate", "/api/show"]


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(ROUTES), body=FIELDS | JSON)
def test_fuzzed_bodies_never_get_a_500(server, path, body):
    r = _post(server, path, body)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:        # each API's own error shape
        answer = r.json()
        if path.startswith("/api/"):
            assert set(answer) == {"error"} and isinstance(answer["error"], str)
        elif path.startswith("/v1/messages"):
            assert answer["type"] == "error" and "message" in answer["error"]
        else:
            assert "message" in answer["error"]


def test_a_short_soak_completes_every_request_and_leaks_no_block(container):
    from support.soak import soak

    report = soak(str(container), clients=4, seconds=8, max_requests=40, ctx=CTX, max_batch=2, max_queue=2, log=lambda m: None)
    assert report.ok, report.failures
    assert report.completed + report.cancelled_by_client + report.refused_429 + report.client_errors_4xx >= 8
    assert report.completed >= 4 and report.kv_blocks_held_at_end == 0
