"""OpenAI `logprobs` / `top_logprobs` (chat) and `logprobs` (completions) from a live server: the values are the
model's own log-softmax (checked against numpy on the engine's logits for the same prefix), the official `openai`
client reads them streamed and whole, and out-of-range values get a 400 naming the field."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from app.server.app import create_app
from app.service.local import EngineService, LoadOptions
from engine.events import PromptLogitsEvent
from engine.generation.generate import GenerationRequest, stream_generate
from engine.kv import KVCache
from support.live_server import LiveServer

CTX = 256
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server(container):
    service = EngineService(max_queue=4)
    service.load_and_wait(container, LoadOptions(context_length=CTX, max_batch=2))
    live = LiveServer(create_app(service))
    yield live
    live.stop()
    service.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def _engine_logprobs(model, prompt: list[int], generated: list[int]) -> np.ndarray:
    """numpy's log-softmax of the logits that chose each generated token [len(generated), V]."""
    ids = prompt + generated[:-1]
    req = GenerationRequest(prompt=tuple(ids), max_tokens=1, prompt_logits=True)
    events = stream_generate(model.model, model.tokenizer, req, stop_ids=model.stop_ids, cache=KVCache(model.spec, CTX))
    logits = next(e for e in events if isinstance(e, PromptLogitsEvent)).logits   # [T, V]
    return np.stack([_log_softmax(row) for row in logits[len(prompt) - 1:]])


def test_completion_logprobs_are_the_models_log_softmax(model, server):
    prompt = [5, 6, 7, 8]
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 6,
                                                          "temperature": 0.9, "seed": 3, "logprobs": 5}, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    text = r.json()["choices"][0]["text"]
    generated = [model.tokenizer.token_to_id(t) for t in lp["tokens"]]   # the character tokenizer: one char each
    assert "".join(lp["tokens"]) == text and len(generated) == 6
    want = _engine_logprobs(model, prompt, generated)                    # [6, V]
    got = np.array(lp["token_logprobs"])
    np.testing.assert_allclose(got, want[np.arange(6), generated], atol=2e-4)
    for row, tops in zip(want, lp["top_logprobs"]):
        assert len(tops) == 5
        best = np.argsort(-row, kind="stable")[:5]
        assert [model.tokenizer.token_to_id(t) for t in tops] == list(best)
        np.testing.assert_allclose(list(tops.values()), row[best], atol=2e-4)
    assert lp["text_offset"] == list(range(6))


def test_the_openai_client_reads_chat_logprobs_whole(model, client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    assert "".join(c.token for c in content) == r.choices[0].message.content
    prompt = model.tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)
    want = _engine_logprobs(model, prompt, [model.tokenizer.token_to_id(c.token) for c in content])
    for c, row in zip(content, want):
        assert bytes(c.bytes) == c.token.encode()
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert c.top_logprobs[0].token == c.token            # greedy takes the likeliest
        assert c.logprob == pytest.approx(row.max(), abs=2e-4)
        np.testing.assert_allclose([t.logprob for t in c.top_logprobs], np.sort(row)[::-1][:3], atol=2e-4)


def test_the_openai_client_reads_chat_logprobs_streamed(client):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in whole.choices[0].logprobs.content]
    assert all(len(c.top_logprobs) == 2 for c in streamed)


def test_streamed_completion_logprobs_add_up(client):
    chunks = list(client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0, logprobs=2,
                                            stream=True))
    tokens = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    offsets = [o for ch in chunks if ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert "".join(tokens) == "".join(ch.choices[0].text for ch in chunks) and len(tokens) == 6
    assert offsets == list(range(6))


def test_without_logprobs_none_are_sent(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0)
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
])
def test_bad_logprobs_get_a_400_naming_the_field(server, path, body, param):
    base = {"model": "tiny", "max_tokens": 2}
    base.update({"messages": MESSAGES} if "chat" in path else {"prompt": "ab"})
    r = httpx.post(server.url + path, json={**base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err
