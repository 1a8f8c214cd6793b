"""Ollama's API: the official `ollama` client against a live server on loopback. It lists, shows and chats with
the served model, streamed and whole; `options` become Colibri's sampling settings (answers equal the engine's
own under Ollama's defaults); /api/generate continues from the `context` it gave; every mistake gets Ollama's
error shape.

What the client (0.6) needed: nothing but the key as a header (`Client(headers=...)`)."""

from __future__ import annotations

import json
import math

import httpx
import jsonschema
import ollama
import pytest

from app.server.app import create_app
from app.server.http import HttpLimits
from app.server.model_details import parameter_size
from engine.generation.generate import GenerationRequest, stream_generate
from engine.generation.sampling import SamplingParams
from engine.kv import KVCache
from support.live import metrics, open_request, raw_answer, serve, wait_until
from support.live_server import LiveServer
from support.server import paced

KEY = "ollama-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
CTX = 256
MESSAGES = [{"role": "user", "content": "hello there"}]
# Ollama's defaults, which a request that sets only the temperature keeps
OLLAMA = SamplingParams(top_k=40, top_p=0.9, repetition_penalty=1.1, penalty_last_n=64)


@pytest.fixture(scope="module")
def server(container):
    live = serve(container, ctx=CTX, max_batch=2, max_queue=2, api_key=KEY, max_body=64 * 1024)
    # one answer first, however long the kernels take to compile into a cold numba cache
    warm = httpx.post(live.url + "/api/generate", headers=AUTH, timeout=900,
                      json={"model": "tiny", "prompt": "warm", "stream": False, "options": {"num_predict": 4}})
    assert warm.status_code == 200, warm.text
    yield live
    live.stop()
    live.service.close()


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, headers=AUTH, timeout=60)


def _direct(model, prompt: list[int], max_tokens: int, sampling: SamplingParams):
    req = GenerationRequest(prompt=tuple(prompt), max_tokens=max_tokens, sampling=sampling)
    return list(stream_generate(model.model, model.tokenizer, req, stop_ids=model.stop_ids,
                                cache=KVCache(model.spec, CTX)))[-1]


def _chat(model, messages, max_tokens, sampling=OLLAMA):
    return _direct(model, model.tokenizer.encode_chat(messages), max_tokens, sampling)


def test_the_client_lists_shows_and_sees_the_model_loaded(client, server, container):
    listed = client.list().models
    assert [m.model for m in listed] == ["tiny:latest"]
    assert listed[0].details.family == "mixtral" and listed[0].size > 0
    shown = client.show("tiny")
    assert shown.details.family == "mixtral" and "completion" in shown.capabilities
    # the details come from the container's manifest: every tensor's weights, its matrices converted at 4 bits
    tensors = json.loads((container / "manifest.json").read_text())["tensors"].values()
    assert {t["quant"]["bits"] for t in tensors if "quant" in t} == {4}
    count = sum(math.prod(t["shape"]) for t in tensors)
    for details in (listed[0].details, shown.details):
        assert details.parameter_size == parameter_size(count) and details.quantization_level == "4-bit"
    assert shown.modelinfo["mixtral.block_count"] == 3 and shown.modelinfo["mixtral.expert_count"] == 8
    running = client.ps().models
    assert [m.model for m in running] == ["tiny:latest"] and running[0].context_length == CTX
    assert httpx.get(server.url + "/api/version", headers=AUTH).json()["version"].count(".") == 2


def test_a_chat_equals_the_engines_answer_under_ollamas_defaults(model, client):
    r = client.chat(model="tiny", messages=MESSAGES, options={"temperature": 0, "num_predict": 12})
    want = _chat(model, MESSAGES, 12)
    assert r.message.role == "assistant" and r.message.content == want.text
    assert r.done and r.done_reason == "length" and r.eval_count == 12
    assert r.prompt_eval_count == len(model.tokenizer.encode_chat(MESSAGES))
    plain = client.chat(model="tiny:latest", messages=MESSAGES,
                        options={"temperature": 0, "num_predict": 12, "repeat_penalty": 1.0, "top_k": 0})
    assert plain.message.content == _chat(model, MESSAGES, 12, SamplingParams()).text


def test_a_streamed_chat_adds_up_to_the_whole_one(model, client):
    parts = list(client.chat(model="tiny", messages=MESSAGES, stream=True,
                             options={"temperature": 0, "num_predict": 10}))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "length"
    assert "".join(p.message.content for p in parts) == _chat(model, MESSAGES, 10).text
    assert parts[-1].eval_count == 10 and parts[-1].eval_duration > 0 and parts[-1].total_duration > 0


def test_options_map_to_the_sampling_settings(model, client):
    opts = {"temperature": 0.9, "seed": 7, "top_p": 0.8, "top_k": 20, "repeat_penalty": 1.2, "num_predict": 16}
    first = client.chat(model="tiny", messages=MESSAGES, options=opts).message.content
    assert first == client.chat(model="tiny", messages=MESSAGES, options=opts).message.content
    want = _chat(model, MESSAGES, 16, SamplingParams(temperature=0.9, seed=7, top_p=0.8, top_k=20,
                                                     repetition_penalty=1.2, penalty_last_n=64))
    assert first == want.text
    full = client.chat(model="tiny", messages=MESSAGES, options={"temperature": 0, "num_predict": 20}).message.content
    stop = full[6:8]
    cut = client.chat(model="tiny", messages=MESSAGES, options={"temperature": 0, "num_predict": 20, "stop": [stop]})
    assert cut.message.content == full[: full.index(stop)] and cut.done_reason == "stop"


def test_generate_renders_the_template_or_takes_raw_text_and_continues_its_context(model, client):
    r = client.generate(model="tiny", prompt="hello there", options={"temperature": 0, "num_predict": 8})
    assert r.response == _chat(model, MESSAGES, 8).text
    with_system = client.generate(model="tiny", prompt="hello there", system="be brief",
                                  options={"temperature": 0, "num_predict": 8})
    assert with_system.response == _chat(model, [{"role": "system", "content": "be brief"}, *MESSAGES], 8).text
    raw = client.generate(model="tiny", prompt="abc", raw=True, options={"temperature": 0, "num_predict": 8})
    ids = model.tokenizer.encode("abc")
    assert raw.response == _direct(model, ids, 8, OLLAMA).text
    assert list(raw.context) == [*ids, *_direct(model, ids, 8, OLLAMA).tokens]
    more = client.generate(model="tiny", prompt="de", raw=True, context=raw.context,
                           options={"temperature": 0, "num_predict": 4})
    again = [*raw.context, *model.tokenizer.encode("de", add_special_tokens=False)]
    assert more.response == _direct(model, again, 4, OLLAMA).text
    streamed = list(client.generate(model="tiny", prompt="abc", raw=True, stream=True,
                                    options={"temperature": 0, "num_predict": 8}))
    assert "".join(p.response for p in streamed) == raw.response and list(streamed[-1].context) == list(raw.context)
    loaded = client.generate(model="tiny")              # an empty prompt loads the model
    assert loaded.done and loaded.done_reason == "load"


def test_a_num_predict_past_the_context_fills_it(model, client):
    room = CTX - len(model.tokenizer.encode_chat(MESSAGES))
    for n in (-1, -2, 100_000):
        r = client.chat(model="tiny", messages=MESSAGES, options={"temperature": 0, "num_predict": n})
        assert r.eval_count == room and r.done_reason == "length"


# bounded values: the random model would write an integer's digits until the tokens run out
FLAGS = {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"enum": ["a", "b"]}},
         "required": ["x", "y"], "additionalProperties": False}


def test_format_constrains_the_answer_to_json_or_a_schema(client):
    """The random model writes no JSON by itself: the grammar makes it, on chat and generate, streamed or not.
    Greedy, so the answers are the same on every run: sampled, the random model can still be inside a number when
    the tokens run out, where no steering can close it."""
    r = client.chat(model="tiny", messages=MESSAGES, format=FLAGS, options={"temperature": 0, "num_predict": 60})
    jsonschema.validate(json.loads(r.message.content), FLAGS)
    text = "".join(part.response for part in client.generate(model="tiny", prompt="a point", format=FLAGS,
                                                              stream=True, options={"temperature": 0,
                                                                                    "num_predict": 60}))
    jsonschema.validate(json.loads(text), FLAGS)
    r = client.generate(model="tiny", prompt="anything", format="json", options={"temperature": 0, "num_predict": 60})
    assert isinstance(json.loads(r.response), dict)


def test_the_client_raises_with_ollamas_error(client, server):
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="llama9", messages=MESSAGES)
    assert caught.value.status_code == 404 and "not found" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="tiny", messages=MESSAGES, options={"temperature": "hot"})
    assert caught.value.status_code == 400 and "temperature" in caught.value.error
    keyless = ollama.Client(host=server.url, timeout=60)
    with pytest.raises(ollama.ResponseError) as caught:
        keyless.list()
    assert caught.value.status_code == 401 and "API key" in caught.value.error


def _raw(server, body: bytes, path="/api/chat") -> httpx.Response:
    return httpx.post(server.url + path, content=body, timeout=60, headers={**AUTH, "content-type": "application/json"})


@pytest.mark.parametrize("path, body, status, words", [
    ("/api/chat", b"{not json", 400, "not valid JSON"),
    ("/api/chat", json.dumps({"model": "tiny"}).encode(), 400, "messages"),
    ("/api/chat", json.dumps({"model": "tiny", "messages": [{"role": "bot", "content": "x"}]}).encode(), 400, "role"),
    ("/api/chat", json.dumps({"model": "tiny", "messages": MESSAGES, "options": {"num_predict": 0}}).encode(), 400,
     "num_predict"),
    ("/api/chat", json.dumps({"model": "tiny", "messages": MESSAGES, "options": {"top_p": 0}}).encode(), 400, "top_p"),
    ("/api/chat", json.dumps({"model": "tiny", "messages": MESSAGES, "format": "yaml"}).encode(), 400,
     'format must be "json" or a JSON Schema'),
    ("/api/chat", json.dumps({"model": "tiny", "messages": MESSAGES, "format": {"type": "strng"}}).encode(), 400,
     "format: "),
    ("/api/chat", json.dumps({"model": "tiny", "messages": MESSAGES, "stream": "yes"}).encode(), 400, "stream"),
    ("/api/chat", json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 400}]}).encode(), 400,
     "context holds 256"),
    ("/api/generate", json.dumps({"model": "tiny", "prompt": "a", "context": [5, 99999]}).encode(), 400,
     "outside the vocabulary"),
    ("/api/generate", json.dumps({"model": "tiny", "prompt": "a", "images": ["aGk="]}).encode(), 400, "images"),
    ("/api/show", json.dumps({}).encode(), 400, "model"),
    ("/api/show", json.dumps({"model": "llama9"}).encode(), 404, "not found"),
    ("/api/pull", json.dumps({"model": "llama9"}).encode(), 404, "Not Found"),
])
def test_bad_requests_get_ollama_shaped_errors(server, path, body, status, words):
    r = _raw(server, body, path)
    assert r.status_code == status, r.text
    answer = r.json()
    assert set(answer) == {"error"} and isinstance(answer["error"], str) and words in answer["error"], answer


def test_refusals_below_the_app_answer_in_ollamas_shape(server):
    """408 and 431, written by the HTTP protocol rather than the app, read the path from the request line."""
    live = LiveServer(create_app(server.service), HttpLimits(head_timeout=1.0, body_timeout=1.0, linger=1.0))
    try:
        status, body = raw_answer(live.port, b"POST /api/chat HTTP/1.1\r\nhost: x\r\n")
        assert status == 408 and set(body) == {"error"} and "head did not arrive" in body["error"]
        status, body = raw_answer(live.port, b"POST /api/generate?x=1 HTTP/1.1\r\nhost: x\r\ncontent-length: 9\r\n\r\n{")
        assert status == 408 and set(body) == {"error"} and "body did not arrive" in body["error"]
        r = httpx.get(live.url + "/api/tags", headers={"x-big": "a" * 200_000}, timeout=10)
        assert r.status_code == 431 and set(r.json()) == {"error"}
        r = httpx.get(live.url + "/health", headers={"x-big": "a" * 200_000}, timeout=10)
        assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_fields_too_large"  # OpenAI's
    finally:
        live.stop()


def test_a_full_queue_answers_429_in_ollamas_shape(container, monkeypatch):
    live = serve(container, ctx=CTX, max_batch=1, max_queue=0)
    paced(monkeypatch)
    try:
        client = ollama.Client(host=live.url, timeout=60)
        running = client.chat(model="tiny", messages=MESSAGES, stream=True,
                              options={"temperature": 0, "num_predict": 200})
        next(running)                                       # the first request is in the batch now
        with pytest.raises(ollama.ResponseError) as caught:
            client.chat(model="tiny", messages=MESSAGES, options={"num_predict": 4})
        assert caught.value.status_code == 429 and "retry shortly" in caught.value.error
        running.close()
        assert live.served.counters.rejected == 1
    finally:
        live.stop()
        live.service.close()


def test_a_client_that_leaves_a_stream_is_cancelled_and_counted(server, monkeypatch):
    paced(monkeypatch, 0.05)
    before = metrics(server.url, KEY)
    body = {"model": "tiny", "messages": MESSAGES, "options": {"temperature": 0, "num_predict": 200}}
    sock = open_request(server.port, "/api/chat", body, key=KEY)
    wait_until(lambda: metrics(server.url, KEY)["kv_blocks_used"] > 0, 20, "the request never ran")
    sock.close()
    wait_until(lambda: metrics(server.url, KEY)["kv_blocks_used"] == 0, 3, "the abandoned stream holds KV blocks")
    after = metrics(server.url, KEY)
    assert after["requests_cancelled_total"] == before["requests_cancelled_total"] + 1
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < 200
