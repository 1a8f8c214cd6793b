"""A client that leaves is cancelled at once, whatever it asked for: streamed or whole, running or still
queued. Its queue slot and KV blocks come back, so live clients are served instead of refused; and a 500
is counted as an error. Real sockets against a uvicorn server on loopback (issue 29, failure 1)."""

from __future__ import annotations

import threading

import httpx
import pytest

from support.live import metrics, open_request, serve, wait_until
from support.server import paced

CTX = 256
MESSAGES = [{"role": "user", "content": "hello there"}]
# greedy, so no end-of-sequence token comes early: 200 tokens at 50 ms a step last 10 s, far longer than the
# few hundred milliseconds a test waits for a cancelled request to end
LONG = {"model": "tiny", "max_tokens": 200, "temperature": 0}


@pytest.fixture
def live(container, request):
    """A server with a batch of `max_batch` and `max_queue` waiting (the test's parameter, default (1, 2))."""
    max_batch, max_queue = getattr(request, "param", (1, 2))
    server = serve(container, ctx=CTX, max_batch=max_batch, max_queue=max_queue)
    yield server
    server.stop()
    server.service.close()


def _idle(live) -> bool:
    m = metrics(live.url)
    return m["running"] == 0 and m["queue_depth"] == 0 and m["kv_blocks_used"] == 0


@pytest.mark.parametrize("live", [(2, 2)], indirect=True)
def test_a_whole_answer_whose_client_left_stops_at_once(live, monkeypatch):
    """`curl -m 1` of a non-streaming request: the generation stops, long before its max_tokens."""
    paced(monkeypatch, 0.05)
    counters = live.served.counters
    sock = open_request(live.port, "/v1/chat/completions", {**LONG, "messages": MESSAGES})
    wait_until(lambda: metrics(live.url)["running"] == 1, 20, "the request never ran")
    sock.close()
    wait_until(lambda: _idle(live), 3, "the abandoned request still runs or holds KV blocks")
    assert counters.cancelled == 1 and counters.generated_tokens < 200


def test_queued_clients_that_leave_free_their_slots(live, monkeypatch):
    """A streamed request that has sent nothing yet and a whole one, both waiting for the batch, then gone:
    the queue empties at once, and a live client is served (200) rather than refused (429)."""
    paced(monkeypatch, 0.05)
    counters = live.served.counters
    url = live.url
    with httpx.stream("POST", url + "/v1/chat/completions", json={**LONG, "messages": MESSAGES, "stream": True},
                      timeout=30) as running:
        lines = running.iter_lines()        # held: a dropped iterator closes the connection
        next(lines)                         # in the batch now
        # /v1/completions streams nothing until the first token: a queued stream is silent
        streamed = open_request(live.port, "/v1/completions", {**LONG, "prompt": "abc", "stream": True})
        whole = open_request(live.port, "/v1/chat/completions", {**LONG, "messages": MESSAGES})
        wait_until(lambda: metrics(url)["queue_depth"] == 2, 20, "the two requests never queued")
        full = httpx.post(url + "/v1/completions", json={**LONG, "prompt": "x"}, timeout=30)
        assert full.status_code == 429
        streamed.close()
        whole.close()
        wait_until(lambda: metrics(url)["queue_depth"] == 0, 3, "the queue kept the slots of clients that left")
        assert metrics(url)["running"] == 1 and counters.cancelled == 2
        answer: list[httpx.Response] = []
        late = threading.Thread(target=lambda: answer.append(
            httpx.post(url + "/v1/completions", json={**LONG, "prompt": "x", "max_tokens": 3}, timeout=60)))
        late.start()
        wait_until(lambda: answer or metrics(url)["queue_depth"] == 1, 20, "the live client was not queued")
    late.join(60)                          # the running stream left: the live client runs next
    assert answer[0].status_code == 200, answer[0].text
    assert answer[0].json()["usage"]["completion_tokens"] == 3
    wait_until(lambda: _idle(live), 5, "a request still holds the batch, the queue or KV blocks")
    assert counters.cancelled == 3 and counters.rejected == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_client_that_leaves_a_stream_while_running_frees_its_blocks(live, monkeypatch, path):
    paced(monkeypatch, 0.05)
    body = {**LONG, "stream": True, **({"messages": MESSAGES} if "chat" in path else {"prompt": "abc"})}
    sock = open_request(live.port, path, body)
    wait_until(lambda: metrics(live.url)["kv_blocks_used"] > 0, 20, "the request never ran")
    sock.close()
    wait_until(lambda: _idle(live), 3, "the abandoned stream still runs or holds KV blocks")
    assert live.served.counters.cancelled == 1


def test_an_internal_error_is_counted(live, monkeypatch):
    """A 500 (a fault of the server, not of the client) shows in colibri_request_errors_total."""
    before = metrics(live.url)["request_errors_total"]

    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer fault")

    monkeypatch.setattr(live.service.tokenizer, "encode", broken)
    r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 2}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert metrics(live.url)["request_errors_total"] == before + 1


def test_a_generation_held_behind_a_model_change_leaves_when_cancelled(container, monkeypatch):
    """A generation queued behind an unload (held until the batch ends) stops counting as waiting as soon as
    it is cancelled, not once the running one has finished."""
    from app.service.local import EngineService, Generation, LoadOptions
    from engine.events import DoneEvent

    paced(monkeypatch, 0.05)
    ended: dict[int, DoneEvent] = {}

    def listen(event):
        if isinstance(event, Generation) and isinstance(event.event, DoneEvent):
            ended[event.request] = event.event

    with EngineService(max_queue=1) as service:
        service.load_and_wait(container, LoadOptions(context_length=CTX, max_batch=1))
        running = service.generate([5, 6, 7], max_tokens=200, listener=listen)
        wait_until(lambda: service.batch == 1, 20, "the first generation never ran")
        service.unload()
        held = service.generate([5, 6, 7], max_tokens=200, listener=listen)
        assert service.queue_depth == 1
        service.cancel(held)
        wait_until(lambda: held in ended, 3, "the cancelled generation waited for the batch to end")
        assert ended[held].finish_reason == "cancelled" and service.queue_depth == 0
        assert running not in ended and service.batch == 1
        service.cancel(running)
        wait_until(lambda: running in ended, 3, "the running generation did not stop")
