"""`response_format` by grammar-constrained decoding (llguidance): on the tiny random model, whose own choices are
no JSON at all, the official `openai` client gets JSON that validates against the schema (`jsonschema`) and parses
for `json_object`, streamed and whole, greedy and sampled; two requests batched together each get their own valid
answer; a bad schema gets a 400 naming the problem."""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import openai
import pytest

from app.server.app import create_app
from app.service.local import EngineService, LoadOptions
from support.live_server import LiveServer
from support.tiny_chat import CHARS

CTX = 512
MESSAGES = [{"role": "user", "content": "describe a person"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
POINT = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "boolean"}},
         "required": ["x", "y"], "additionalProperties": False}


def _schema(schema: dict, name: str = "person") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def server(container):
    service = EngineService(max_queue=4)
    service.load_and_wait(container, LoadOptions(context_length=CTX, max_batch=2))
    live = LiveServer(create_app(service))
    live.service = service
    yield live
    live.stop()
    service.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_schema_answer_validates(client, temperature):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, temperature=temperature,
                                       seed=7, response_format=_schema(PERSON))
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_a_streamed_json_schema_answer_validates(client):
    chunks = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0.8, seed=3,
                                            response_format=_schema(POINT, "point"), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), POINT)


def test_json_object_parses_on_both_routes(client):
    # A random model never chooses to close an object of free keys; a bias towards "}" (applied before the mask,
    # so "}" wins only where the grammar allows it) ends the object at the first place the grammar allows.
    close = {str(CHARS.index("}") + 1): 100}     # the character tokenizer: id i + 1 is CHARS[i]
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0.7, seed=1,
                                       response_format={"type": "json_object"}, logit_bias=close)
    assert r.choices[0].finish_reason == "stop"
    assert json.loads(r.choices[0].message.content) == {}
    c = client.completions.create(model="tiny", prompt="hello", max_tokens=200, temperature=0.0, logit_bias=close,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert c.choices[0].finish_reason == "stop" and json.loads(c.choices[0].text) == {}

    # without the bias the object would run on; near max_tokens the constraint steers it to close
    for limit in (12, 40):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=limit, temperature=0.7,
                                           seed=1, response_format={"type": "json_object"})
        assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
        assert r.usage.completion_tokens <= limit


def test_json_that_closes_on_the_last_allowed_token_finishes_stop(client, server):
    # "{}" is two tokens: with max_tokens 2 the budget ends where only the end of the answer may follow, so the
    # answer is whole ("stop"), not cut ("length")
    close = {str(CHARS.index("}") + 1): 100}
    for stream in (False, True):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0.0,
                                           response_format={"type": "json_object"}, logit_bias=close, stream=stream,
                                           **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert text == "{}" and reason == ["stop"] and chunks[-1].usage.completion_tokens == 2
        else:
            assert r.choices[0].message.content == "{}" and r.usage.completion_tokens == 2
            assert r.choices[0].finish_reason == "stop"
    # a budget that ends before the object closes is still "length"
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0.0,
                                       response_format={"type": "json_object"}, logit_bias=close)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 1


def test_two_concurrent_requests_each_keep_their_own_grammar(client):
    # max_batch=2: both run in the same steps, each row masked by its own sequence's matcher (the scheduler's own
    # test, tests/generation/test_grammar.py, checks that they really share steps)
    answers: dict[str, str] = {}

    def ask(name: str, schema: dict) -> None:
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, temperature=1.0, seed=11,
                                           response_format=_schema(schema, name))
        answers[name] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=("person", PERSON)), threading.Thread(target=ask, args=("point", POINT))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    jsonschema.validate(json.loads(answers["person"]), PERSON)
    jsonschema.validate(json.loads(answers["point"]), POINT)


@pytest.mark.parametrize("response_format, words", [
    (_schema({"type": "object", "properties": {"a": {"type": "strng"}}}), "strng"),
    (_schema({"type": "object", "required": 3}), "required"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "xml"}, "type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "JSON object"),
])
def test_a_bad_response_format_gets_a_400_naming_the_problem(server, response_format, words):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 5,
                                                               "response_format": response_format}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith("response_format") and words in err["message"], err
