"""`colibri serve` and text that is not valid Unicode (issue 29): a lone surrogate in a prompt, a message
or a stop sequence is read as U+FFFD, on both routes, streamed or not; it used to be an HTTP 500."""

from __future__ import annotations

import json

import httpx
import pytest

from app.server.app import create_app
from app.service.local import EngineService, LoadOptions
from support.live_server import LiveServer as Live
from support.tiny_chat import tiny_models

CTX = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    _, container = tiny_models(tmp_path_factory.getbasetemp())
    service = EngineService(max_queue=4)
    service.load_and_wait(container, LoadOptions(context_length=CTX, max_batch=2))
    live = Live(create_app(service))
    live.model = container.name
    yield live
    live.stop()
    service.close()


def _body(route: str, text: str, **extra) -> bytes:
    """A request body whose text field holds TEXT; json.dumps writes a lone surrogate as its \\u escape."""
    field = {"prompt": text} if route == "completions" else {"messages": [{"role": "user", "content": text}]}
    return json.dumps({"max_tokens": 4, "temperature": 0, **field, **extra}).encode()


def _ask(server, route: str, body: bytes, stream: bool) -> tuple[int, str]:
    """(status, generated text) of one request, read whole or as server-sent events."""
    url = f"{server.url}/v1/{'completions' if route == 'completions' else 'chat/completions'}"
    headers = {"content-type": "application/json"}
    body = json.dumps({"model": server.model, **json.loads(body)}).encode()   # json keeps a lone surrogate escaped
    if not stream:
        r = httpx.post(url, content=body, headers=headers, timeout=60)
        if r.status_code != 200:
            return r.status_code, r.text
        choice = r.json()["choices"][0]
        return 200, choice["text"] if route == "completions" else choice["message"]["content"]
    body = json.dumps({**json.loads(body), "stream": True}).encode()
    text = []
    with httpx.stream("POST", url, content=body, headers=headers, timeout=60) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"]
                if choice:
                    text.append(choice[0].get("text") or choice[0].get("delta", {}).get("content") or "")
    return 200, "".join(text)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_lone_surrogate_is_read_as_the_replacement_character(server, route, stream):
    status, text = _ask(server, route, _body(route, "hi \ud800"), stream)
    assert status == 200, text
    # the same answer as for the text with U+FFFD written out
    assert (status, text) == _ask(server, route, _body(route, "hi \ufffd"), stream)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_an_escaped_surrogate_pair_is_the_character_it_encodes(server, route):
    # '"\ud83d\ude00"' in JSON is one emoji, valid text: answered exactly as the emoji itself
    pair = _body(route, "smile ").replace(b'smile "', b'smile \\ud83d\\ude00"')
    assert b"\\ud83d\\ude00" in pair
    status, text = _ask(server, route, pair, False)
    assert status == 200, text
    assert (status, text) == _ask(server, route, _body(route, "smile \U0001F600"), False)


def test_a_lone_surrogate_in_a_stop_sequence(server):
    status, text = _ask(server, "completions", _body("completions", "hi", stop=["\udcff", "x\ud800"]), False)
    assert status == 200, text
    assert _ask(server, "completions", _body("completions", "hi", stop=["\ufffd", "x\ufffd"]), False) == (200, text)
