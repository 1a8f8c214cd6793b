"""RemoteService passes log-probabilities and structured output through a Colibri server: each token's
log-probability and alternatives come back equal to what the engine service behind the server gives for the same
greedy answer, and a JSON-schema grammar reaches the server as its `response_format`, so the answer matches the
schema and equals the local constrained answer. A grammar no API can carry is refused with the reason."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest

from app.service.messages import Generation
from app.service.remote import UNKNOWN_TOKEN, RemoteService
from engine.events import DoneEvent, ErrorEvent, TokenEvent
from engine.generation.grammar import json_schema_grammar, lark_grammar
from engine.generation.sampling import SamplingParams
from support.live import serve
from support.tiny_chat import tiny_models

KEY = "remote-scores-key-0123"
MESSAGES = [{"role": "user", "content": "hello there"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
TIMEOUT = 600           # s: a first answer compiles kernels on a cold cache


class Collected:
    """Events of one request, and an event set when it ends."""

    def __init__(self):
        self.events: list = []
        self.ended = threading.Event()

    def __call__(self, event) -> None:
        if isinstance(event, Generation):
            self.events.append(event.event)
            if isinstance(event.event, (DoneEvent, ErrorEvent)):
                self.ended.set()

    def wait(self) -> tuple[list[TokenEvent], DoneEvent | ErrorEvent]:
        assert self.ended.wait(TIMEOUT), self.events[-3:]
        return [e for e in self.events if isinstance(e, TokenEvent)], self.events[-1]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    _, container = tiny_models(tmp_path_factory.getbasetemp())
    server = serve(container, ctx=256, max_batch=2, max_queue=2, api_key=KEY)
    yield server
    server.stop()
    server.service.close()


def _local(live, **kw) -> tuple[list[TokenEvent], DoneEvent]:
    got = Collected()
    if "prompt" not in kw:
        kw["messages"] = MESSAGES
    live.service.generate(sampling=SamplingParams(), listener=got, **kw)
    tokens, done = got.wait()
    assert isinstance(done, DoneEvent), done
    return tokens, done


def _remote(live, **kw) -> tuple[list[TokenEvent], DoneEvent | ErrorEvent]:
    got = Collected()
    with RemoteService(live.url, KEY, on_event=got) as remote:
        if "prompt" not in kw:
            kw["messages"] = MESSAGES
        remote.generate(sampling=SamplingParams(), **kw)
        return got.wait()


@pytest.mark.parametrize("prompt", [None, (5, 6, 7, 8)])        # a chat, and a completion of token ids
def test_logprobs_come_back_as_the_engine_gives_them(live, prompt):
    ask = {"prompt": prompt} if prompt else {}
    want, done = _local(live, max_tokens=8, logprobs=3, **ask)
    tokens, end = _remote(live, max_tokens=8, logprobs=3, **ask)
    assert isinstance(end, DoneEvent) and end.text == done.text
    assert len(tokens) == len(want) == 8
    tokenizer = live.service.tokenizer
    for got, w in zip(tokens, want):
        assert got.token_id == UNKNOWN_TOKEN and got.logprob == w.logprob
        assert [lp for _, lp in got.top_logprobs] == [lp for _, lp in w.top_logprobs] and len(w.top_logprobs) == 3
        assert got.pieces == tuple(tokenizer.decode([i]) for i in (w.token_id, *(i for i, _ in w.top_logprobs)))
    assert "".join(t.text for t in tokens) == done.text


def test_a_json_schema_grammar_reaches_the_server(live):
    grammar = json_schema_grammar(SCHEMA, "flags")
    _, done = _local(live, max_tokens=40, grammar=grammar)
    tokens, end = _remote(live, max_tokens=40, grammar=grammar)
    assert isinstance(end, DoneEvent), end
    jsonschema.validate(json.loads(end.text), SCHEMA)
    assert end.text == done.text == "".join(t.text for t in tokens)


def test_a_grammar_no_api_carries_is_refused_with_the_reason(live):
    _, end = _remote(live, max_tokens=4, grammar=lark_grammar('start: "yes" | "no"', "yes or no"))
    assert isinstance(end, ErrorEvent) and "yes or no" in end.message and "response_format" in end.message
