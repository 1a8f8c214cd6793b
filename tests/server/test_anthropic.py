"""Anthropic's Messages API: the official `anthropic` client against a live server on loopback. Answers equal
the engine's own, streamed events come in Anthropic's order, count_tokens counts what the template renders, the
key goes as x-api-key or Bearer, and every mistake gets Anthropic's error shape.

What the client (2.17) needed: nothing for chat, streaming, stop_sequences, count_tokens and the key; its
`messages.create` has no `temperature`, `top_p` or `top_k` parameters any more, so they go in `extra_body`."""

from __future__ import annotations

import json
import socket

import anthropic
import httpx
import jsonschema
import pytest

from app.server.app import create_app
from app.server.http import HttpLimits
from app.service.local import EngineService, LoadOptions
from engine.generation.generate import GenerationRequest, stream_generate
from engine.generation.sampling import SamplingParams
from engine.kv import KVCache
from support.live import metrics, open_request, raw_answer, serve, wait_until
from support.live_server import LiveServer
from support.reasoning_chat import ANSWER_TOKENS, thinking_model
from support.reasoning_chat import MESSAGES as THINK_MESSAGES
from support.server import paced

KEY = "anthropic-key-0123456789"
CTX = 256
MESSAGES = [{"role": "user", "content": "hello there"}]
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(container):
    live = serve(container, ctx=CTX, max_batch=2, max_queue=2, api_key=KEY, max_body=64 * 1024)
    # One answer first, however long the kernels take to compile into a cold numba cache: the client's requests
    # below each have a minute, which is for answering, not compiling.
    warm = httpx.post(live.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=900,
                      json={"model": "tiny", "max_tokens": 4, "messages": MESSAGES})
    assert warm.status_code == 200, warm.text
    yield live
    live.stop()
    live.service.close()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def _direct(model, messages, max_tokens, sampling=SamplingParams(), prefill=""):
    text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True) + prefill
    prompt = model.tokenizer.encode(text, add_special_tokens=False)
    req = GenerationRequest(prompt=tuple(prompt), max_tokens=max_tokens, sampling=sampling)
    return list(stream_generate(model.model, model.tokenizer, req, stop_ids=model.stop_ids,
                                cache=KVCache(model.spec, CTX)))[-1]


def test_a_message_equals_the_engines_answer(model, client):
    r = client.messages.create(model="tiny", max_tokens=12, messages=MESSAGES, extra_body=GREEDY)
    want = _direct(model, MESSAGES, 12)
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want.text
    assert r.role == "assistant" and r.model == "tiny" and r.id.startswith("msg_")
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    assert r.usage.output_tokens == 12 and r.usage.input_tokens == len(model.tokenizer.encode_chat(MESSAGES))


def test_system_and_a_prefilled_answer_go_through_the_template(model, client):
    system = "be brief"
    r = client.messages.create(model="tiny", max_tokens=8, system=system, extra_body=GREEDY,
                               messages=[*MESSAGES, {"role": "assistant", "content": "Sure: "}])
    want = _direct(model, [{"role": "system", "content": system}, *MESSAGES], 8, prefill="Sure: ")
    assert r.content[0].text == want.text
    blocks = client.messages.create(model="tiny", max_tokens=8, extra_body=GREEDY,
                                    system=[{"type": "text", "text": system}],
                                    messages=[{"role": "user", "content": [{"type": "text", "text": "hello "},
                                                                           {"type": "text", "text": "there"}]},
                                              {"role": "assistant", "content": "Sure: "}])
    assert blocks.content[0].text == want.text


def test_the_stream_comes_in_anthropics_event_order(model, client):
    events = list(client.messages.create(model="tiny", max_tokens=10, messages=MESSAGES, stream=True,
                                         extra_body=GREEDY))
    kinds = [e.type for e in events]
    n = len(kinds) - 5
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * n, "content_block_stop",
                     "message_delta", "message_stop"]
    assert events[0].message.stop_reason is None and events[0].message.usage.input_tokens > 0
    assert events[1].content_block.type == "text" and events[1].index == 0
    text = "".join(e.delta.text for e in events[2:-3])
    assert {e.delta.type for e in events[2:-3]} == {"text_delta"}
    assert text == _direct(model, MESSAGES, 10).text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 10


def test_the_raw_stream_sends_a_ping_after_message_start(server):
    # the client skips ping events, so the wire is read as Anthropic documents it: event names and their data
    with httpx.stream("POST", server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                      json={"model": "tiny", "max_tokens": 6, "messages": MESSAGES, "stream": True, **GREEDY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    data = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert all(line.startswith("event: ") for line in lines[0::2]) and len(names) == len(data)
    assert names[:3] == ["message_start", "ping", "content_block_start"] and data[1] == {"type": "ping"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert [d["type"] for d in data] == names


def test_the_clients_stream_helper_reads_the_same_answer(model, client):
    with client.messages.stream(model="tiny", max_tokens=10, messages=MESSAGES, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == _direct(model, MESSAGES, 10).text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10


def test_stop_sequences_end_the_answer_and_are_named(client):
    full = client.messages.create(model="tiny", max_tokens=20, messages=MESSAGES, extra_body=GREEDY).content[0].text
    stop = full[6:8]
    r = client.messages.create(model="tiny", max_tokens=20, messages=MESSAGES, stop_sequences=["never", stop],
                               extra_body=GREEDY)
    assert r.content[0].text == full[: full.index(stop)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    streamed = list(client.messages.create(model="tiny", max_tokens=20, messages=MESSAGES, stream=True,
                                           stop_sequences=[stop], extra_body=GREEDY))
    assert streamed[-2].delta.stop_reason == "stop_sequence" and streamed[-2].delta.stop_sequence == stop


def test_temperature_and_top_k_are_honoured_through_extra_body(model, client):
    greedy = _direct(model, MESSAGES, 16).text
    # top_k 1 keeps only the likeliest token: greedy whatever the temperature
    r = client.messages.create(model="tiny", max_tokens=16, messages=MESSAGES,
                               extra_body={"temperature": 1.0, "top_k": 1})
    assert r.content[0].text == greedy
    hot = {client.messages.create(model="tiny", max_tokens=16, messages=MESSAGES,
                                  extra_body={"temperature": 1.0, "top_p": 1.0}).content[0].text for _ in range(3)}
    assert hot != {greedy}      # sampled at temperature 1 over 160 tokens: 16 greedy picks three times is ~never


POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False}


def test_output_config_format_constrains_the_answer_to_the_schema(client):
    """The random model writes no JSON by itself: the grammar makes it, whole and streamed, under either name."""
    fmt = {"type": "json_schema", "schema": POINT}
    r = client.messages.create(model="tiny", max_tokens=60, messages=MESSAGES, output_config={"format": fmt},
                               extra_body=GREEDY)
    jsonschema.validate(json.loads(r.content[0].text), POINT)
    with client.messages.stream(model="tiny", max_tokens=60, messages=MESSAGES, extra_body={**GREEDY, "output_format": fmt}) \
            as stream:
        text = "".join(stream.text_stream)
    jsonschema.validate(json.loads(text), POINT)
    for bad, words in (({"format": {"type": "yaml"}}, "must be"), ({"format": {"type": "json_schema", "schema": {
            "type": "strng"}}}, "output_config.format.schema")):
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model="tiny", max_tokens=8, messages=MESSAGES, output_config=bad)
        assert caught.value.body["error"]["type"] == "invalid_request_error"
        assert words in caught.value.body["error"]["message"]


def test_count_tokens_counts_what_the_template_renders(model, client):
    count = client.messages.count_tokens(model="tiny", messages=MESSAGES, system="be brief")
    want = model.tokenizer.encode_chat([{"role": "system", "content": "be brief"}, *MESSAGES])
    assert count.input_tokens == len(want)
    r = client.messages.create(model="tiny", max_tokens=1, messages=MESSAGES, system="be brief", extra_body=GREEDY)
    assert r.usage.input_tokens == count.input_tokens


def test_tool_use_and_tool_result_blocks_are_rendered_by_the_template(model, client):
    messages = [*MESSAGES,
                {"role": "assistant", "content": [{"type": "text", "text": "let me look"},
                                                  {"type": "tool_use", "id": "tu_1", "name": "weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "sunny"},
                                             {"type": "text", "text": "so?"}]}]
    count = client.messages.count_tokens(model="tiny", messages=messages)
    # the tiny template prints each turn's role and content: the tool result is a `tool` turn
    rendered = [*MESSAGES, {"role": "assistant", "content": "let me look"}, {"role": "tool", "content": "sunny"},
                {"role": "user", "content": "so?"}]
    assert count.input_tokens == len(model.tokenizer.encode_chat(rendered))
    r = client.messages.create(model="tiny", max_tokens=6, messages=messages, extra_body=GREEDY)
    assert r.content[0].text == _direct(model, rendered, 6).text


def test_an_over_large_max_tokens_is_clamped_alike_on_both_apis(model, client, server):
    """The answer fills the context and says so: Anthropic's stop reason names the context window, OpenAI's
    finish reason is "length"; both generate exactly the room the prompt leaves."""
    room = CTX - len(model.tokenizer.encode_chat(MESSAGES))
    r = client.messages.create(model="tiny", max_tokens=100_000, messages=MESSAGES, extra_body=GREEDY)
    assert r.stop_reason == "model_context_window_exceeded" and r.usage.output_tokens == room
    o = httpx.post(server.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 100_000, "temperature": 0}).json()
    assert o["choices"][0]["finish_reason"] == "length" and o["usage"]["completion_tokens"] == room
    assert o["choices"][0]["message"]["content"] == r.content[0].text


def test_the_key_goes_as_x_api_key_or_bearer(server):
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0, timeout=60)
    assert bearer.messages.count_tokens(model="tiny", messages=MESSAGES).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong-key-000000", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model="tiny", max_tokens=4, messages=MESSAGES)
    assert caught.value.body["error"]["type"] == "authentication_error"
    assert "x-api-key" in caught.value.body["error"]["message"]


def _raw(server, body: bytes, path="/v1/messages") -> httpx.Response:
    return httpx.post(server.url + path, content=body, timeout=60,
                      headers={"x-api-key": KEY, "content-type": "application/json"})


@pytest.mark.parametrize("body, status, kind, words", [
    (b"{not json", 400, "invalid_request_error", "not valid JSON"),
    (json.dumps({"model": "tiny", "messages": MESSAGES}).encode(), 400, "invalid_request_error", "max_tokens"),
    (json.dumps({"model": "tiny", "max_tokens": 0, "messages": MESSAGES}).encode(), 400, "invalid_request_error",
     "max_tokens"),
    (json.dumps({"model": "tiny", "max_tokens": 4, "messages": MESSAGES, "temperature": 1.5}).encode(), 400,
     "invalid_request_error", "temperature"),
    (json.dumps({"model": "tiny", "max_tokens": 4, "messages": MESSAGES, "top_k": True}).encode(), 400,
     "invalid_request_error", "top_k"),
    (json.dumps({"model": "tiny", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}).encode(), 400,
     "invalid_request_error", "role"),
    (json.dumps({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}).encode(), 400,
     "invalid_request_error", "text only"),
    (json.dumps({"model": "tiny", "max_tokens": 4, "messages": MESSAGES,
                 "tools": [{"name": "t", "input_schema": {"type": "object"}}]}).encode(), 400,
     "invalid_request_error", "tools"),
    (json.dumps({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 400}]}).encode(),
     400, "invalid_request_error", "context holds 256"),
    (json.dumps({"model": "claude-opus-9", "max_tokens": 4, "messages": MESSAGES}).encode(), 404, "not_found_error",
     "not served here"),
    (b"[]", 400, "invalid_request_error", ""),
])
def test_bad_requests_get_anthropic_shaped_errors(server, body, status, kind, words):
    r = _raw(server, body)
    assert r.status_code == status, r.text
    answer = r.json()
    assert set(answer) == {"type", "error"} and answer["type"] == "error"
    assert answer["error"]["type"] == kind and words in answer["error"]["message"]


def test_the_client_raises_with_anthropics_error_body(client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-opus-9", max_tokens=4, messages=MESSAGES)
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(model="tiny", messages=[])
    assert caught.value.body["type"] == "error" and "messages" in caught.value.body["error"]["message"]


def test_size_limit_unknown_path_and_missing_key_answer_in_anthropics_shape(server):
    big = json.dumps({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 70000}]})
    r = _raw(server, big.encode())
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(server.url + "/v1/messages/batches", headers={"x-api-key": KEY}, json={})
    assert r.status_code == 404 and r.json()["type"] == "error"
    r = httpx.post(server.url + "/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": MESSAGES})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"       # OpenAI's stays OpenAI's


def test_refusals_below_the_app_answer_in_anthropics_shape(server):
    """408, 431 and 503 are written by the HTTP protocol, not the app: the path read from the request line (as
    far as it came) picks the shape."""
    live = LiveServer(create_app(server.service), HttpLimits(max_connections=2, head_timeout=1.0, body_timeout=3.0,
                                                             linger=1.0))
    busy = []
    try:
        slow_head = b"POST /v1/messages HTTP/1.1\r\nhost: x\r\n"
        status, body = raw_answer(live.port, slow_head)
        assert status == 408 and body["error"]["type"] == "timeout_error" and "head did not" in body["error"]["message"]
        slow_body = b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 60\r\n\r\n{"
        status, body = raw_answer(live.port, slow_body)
        assert status == 408 and body["type"] == "error" and "body did not" in body["error"]["message"]
        r = httpx.post(live.url + "/v1/messages/count_tokens", headers={"x-big": "a" * 200_000}, timeout=10)
        assert r.status_code == 431 and r.json()["error"]["type"] == "request_too_large"
        for _ in range(2):      # every connection carries a request (a slow body): a newcomer is refused
            s = socket.create_connection(("127.0.0.1", live.port), timeout=10)
            s.sendall(slow_body)
            busy.append(s)
        answers: list[httpx.Response] = []
        # the heads are parsed at the server's pace: until then the newcomer evicts one waiting for its head
        wait_until(lambda: answers.append(httpx.post(live.url + "/v1/messages", json={}, timeout=10))
                   or answers[-1].status_code == 503, 5, "no newcomer was refused")
        r = answers[-1]
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error"
    finally:
        for s in busy:
            s.close()
        live.stop()


def test_a_full_queue_answers_429_in_anthropics_shape(container, monkeypatch):
    live = serve(container, ctx=CTX, max_batch=1, max_queue=0)
    paced(monkeypatch)
    try:
        client = anthropic.Anthropic(base_url=live.url, api_key="none", max_retries=0, timeout=60)
        body = {"model": "tiny", "max_tokens": 200, "messages": MESSAGES, "extra_body": GREEDY}
        with client.messages.stream(**body) as running:
            next(iter(running))                             # the first request is in the batch now
            with pytest.raises(anthropic.RateLimitError) as caught:
                client.messages.create(**body)
        assert caught.value.response.headers["retry-after"] == "2"
        assert caught.value.body["error"]["type"] == "rate_limit_error"
        assert live.served.counters.rejected == 1
    finally:
        live.stop()
        live.service.close()


def test_a_client_that_leaves_a_stream_is_cancelled_and_counted(server, monkeypatch):
    paced(monkeypatch, 0.05)
    before = metrics(server.url, KEY)
    body = {"model": "tiny", "max_tokens": 200, "messages": MESSAGES, "stream": True, "temperature": 0}
    sock = open_request(server.port, "/v1/messages", body, key=KEY)
    wait_until(lambda: metrics(server.url, KEY)["kv_blocks_used"] > 0, 20, "the request never ran")
    sock.close()
    wait_until(lambda: metrics(server.url, KEY)["kv_blocks_used"] == 0, 3, "the abandoned stream holds KV blocks")
    after = metrics(server.url, KEY)
    assert after["requests_cancelled_total"] == before["requests_cancelled_total"] + 1
    assert after["requests_total"] == before["requests_total"] + 1


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    return thinking_model(tmp_path_factory.mktemp("thinking"))


def test_reasoning_comes_as_thinking_blocks(thinking):
    service = EngineService()
    service.load_and_wait(thinking.folder, LoadOptions(context_length=CTX))
    live = LiveServer(create_app(service))
    try:
        client = anthropic.Anthropic(base_url=live.url, api_key="none", max_retries=0, timeout=60)
        args = {"model": "default", "max_tokens": ANSWER_TOKENS, "messages": THINK_MESSAGES, "extra_body": GREEDY}
        r = client.messages.create(**args)
        kinds = [b.type for b in r.content]
        thought = "".join(b.thinking for b in r.content if b.type == "thinking")
        said = "".join(b.text for b in r.content if b.type == "text")
        assert "thinking" in kinds and (thought, said) == (thinking.reasoning, thinking.content)
        with client.messages.stream(**args) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == kinds
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in r.content]
        # a thinking block of the history goes back to the template as the turn's reasoning
        history = [*THINK_MESSAGES, {"role": "assistant", "content": "fine"}, {"role": "user", "content": "again"}]
        plain = client.messages.count_tokens(model="default", messages=history).input_tokens
        history[1] = {"role": "assistant", "content": [{"type": "thinking", "thinking": "be kind", "signature": ""},
                                                       {"type": "text", "text": "fine"}]}
        thought = client.messages.count_tokens(model="default", messages=history).input_tokens
        assert thought == plain + len("(be kind) ")     # the template renders it so, one token a character
    finally:
        live.stop()
        service.close()
