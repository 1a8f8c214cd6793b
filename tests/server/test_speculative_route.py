"""A server started with speculative decoding drafts for its answers (its counters show it) and answers exactly what
plain decoding answers; a request may turn drafting off for itself."""

from __future__ import annotations

import httpx
import pytest

from engine.generation.generate import GenerationRequest, stream_generate
from engine.generation.sampling import SamplingParams
from engine.kv import KVCache
from support.live import metrics, serve, wait_until

CTX = 256
PROMPT = "one two three four, one two three four, one two three four, one two"


@pytest.fixture(scope="module")
def server(container):
    live = serve(container, ctx=CTX, max_batch=2, max_queue=2, speculative=True)
    yield live
    live.stop()
    live.service.close()


def _direct(model, prompt: str, n: int, sampling: SamplingParams) -> str:
    ids = model.tokenizer.encode(prompt, add_special_tokens=False)
    request = GenerationRequest(prompt=tuple(ids), max_tokens=n, sampling=sampling)
    return list(stream_generate(model.model, model.tokenizer, request, stop_ids=model.stop_ids,
                                cache=KVCache(model.spec, CTX)))[-1].text


def _complete(server, **body) -> str:
    got = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, **body}, timeout=120)
    assert got.status_code == 200, got.text
    return got.json()["choices"][0]["text"]


def test_answers_draft_and_equal_plain_decoding(server, model):
    assert _complete(server, max_tokens=40, temperature=0) == _direct(model, PROMPT, 40, SamplingParams(temperature=0))
    seeded = dict(max_tokens=40, temperature=0.9, seed=11)
    want = _direct(model, PROMPT, 40, SamplingParams(temperature=0.9, seed=11))
    assert _complete(server, **seeded, speculative=False) == _complete(server, **seeded, speculative=True) == want
    # the counters reach /metrics with the telemetry flushed once the batch is empty
    wait_until(lambda: metrics(server.url).get("draft_tokens_total", 0) > 0, 30, "the server's answers never drafted")
    m = metrics(server.url)
    assert 0 <= m["draft_accepted_total"] <= m["draft_tokens_total"]
