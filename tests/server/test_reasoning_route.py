"""`/v1/chat/completions` with a model that reasons in `<think>`: `reasoning_content` apart from `content`,
whole and streamed, and the history's reasoning accepted back."""

from __future__ import annotations

import json

import httpx
import pytest

from app.server.app import create_app
from app.service.local import EngineService, LoadOptions
from support.live_server import LiveServer
from support.reasoning_chat import ANSWER_TOKENS, MESSAGES, thinking_model


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    return thinking_model(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def server(thinking):
    service = EngineService()
    service.load_and_wait(thinking.folder, LoadOptions(context_length=256))
    live = LiveServer(create_app(service))
    yield live
    live.stop()
    service.close()


def _body(stream: bool, messages=MESSAGES) -> dict:
    return {"model": "default", "messages": messages, "max_tokens": ANSWER_TOKENS, "temperature": 0.0,
            "stream": stream}


def test_answer_holds_reasoning_apart(thinking, server):
    assert thinking.reasoning and thinking.content      # the model's greedy answer has both parts
    answer = httpx.post(server.url + "/v1/chat/completions", json=_body(False), timeout=60).json()
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] == thinking.reasoning
    assert message["content"] == thinking.content
    assert "<think>" not in message["content"] and "</think>" not in message["content"]


def test_streamed_deltas_hold_reasoning_apart(thinking, server):
    reasoning, content = [], []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=_body(True), timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                assert not ("reasoning_content" in delta and delta.get("content"))   # one kind a chunk
                reasoning.append(delta.get("reasoning_content", ""))
                content.append(delta.get("content") or "")
    assert "".join(reasoning) == thinking.reasoning
    assert "".join(content) == thinking.content


def test_history_reasoning_goes_back_to_the_template(server):
    messages = [*MESSAGES, {"role": "assistant", "content": "fine", "reasoning_content": "be kind"},
                {"role": "user", "content": "again"}]
    answer = httpx.post(server.url + "/v1/chat/completions", json=_body(False, messages), timeout=60)
    assert answer.status_code == 200
    usage = answer.json()["usage"]
    plain = [*MESSAGES, {"role": "assistant", "content": "fine"}, {"role": "user", "content": "again"}]
    without = httpx.post(server.url + "/v1/chat/completions", json=_body(False, plain), timeout=60).json()["usage"]
    # the template renders "(be kind) " for the assistant turn: 10 characters, one token each
    assert usage["prompt_tokens"] == without["prompt_tokens"] + len("(be kind) ")


def test_a_remote_service_gets_the_reasoning_apart(thinking, server):
    """The desktop app on another machine: RemoteService reads `reasoning_content` from the stream."""
    import threading

    from app.service.messages import Generation, ModelLoaded
    from app.service.remote import RemoteService
    from engine.events import DoneEvent, TokenEvent
    from engine.generation.sampling import SamplingParams

    events: list = []
    arrived = threading.Event()

    def listen(event) -> None:
        events.append(event)
        if isinstance(event, ModelLoaded) or (isinstance(event, Generation) and isinstance(event.event, DoneEvent)):
            arrived.set()

    with RemoteService(server.url, on_event=listen) as remote:
        remote.load()
        assert arrived.wait(60) and any(isinstance(e, ModelLoaded) for e in events)
        arrived.clear()
        remote.generate(messages=MESSAGES, sampling=SamplingParams(), max_tokens=ANSWER_TOKENS)
        assert arrived.wait(60)
    stream = [e.event for e in events if isinstance(e, Generation)]
    tokens = [e for e in stream if isinstance(e, TokenEvent)]
    done = stream[-1]
    assert (done.reasoning, done.text) == (thinking.reasoning, thinking.content)
    assert "".join(t.reasoning for t in tokens) == thinking.reasoning
    assert "".join(t.text for t in tokens) == thinking.content
