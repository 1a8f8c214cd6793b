"""Generation: cached decoding equals recomputation, and the event stream behaves as promised."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from engine.events import DoneEvent, ErrorEvent, ProgressEvent, PromptLogitsEvent, TokenEvent
from engine.generation.generate import GenerationRequest, StopStrings, generate_step, stream_generate
from engine.generation.prefill import prefill
from engine.generation.sampling import SamplingParams
from engine.kv import KVCache
from engine.loader import load_model
from support.reference import build_checkpoint

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23]


@pytest.fixture(scope="module", params=["llama", "qwen2_moe", "deepseek_v3"])
def tiny(request, tmp_path_factory):
    extra = {
        "llama": {},
        "qwen2_moe": dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6,
                          num_experts_per_tok=2),
        "deepseek_v3": dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                            v_head_dim=16, moe_intermediate_size=32, q_lora_rank=24, n_routed_experts=8,
                            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1),
    }[request.param]
    folder = build_checkpoint(tmp_path_factory.mktemp(request.param), request.param, **extra)
    return load_model(folder)


def test_cached_decoding_equals_recomputation(tiny):
    """Logits of each token decoded one at a time on the cache equal a single pass over everything."""
    seq = PROMPT + [33, 8, 101, 19, 60, 2, 77, 140]
    full = tiny.model.forward(seq, KVCache(tiny.spec, 64), all_logits=True)
    cache = KVCache(tiny.spec, 64)
    rows = [tiny.model.forward(PROMPT, cache, all_logits=True)]
    rows += [tiny.model.forward([t], cache) for t in seq[len(PROMPT):]]
    stepped = np.concatenate(rows)
    assert np.abs(stepped - full).max() <= 1e-5 * np.abs(full).max()


def test_chunked_prefill_equals_one_pass(tiny):
    one = prefill(tiny.model, PROMPT, KVCache(tiny.spec, 64), all_logits=True)
    chunked = prefill(tiny.model, PROMPT, KVCache(tiny.spec, 64), all_logits=True, chunk=5)
    assert np.abs(one - chunked).max() <= 1e-5 * np.abs(one).max()


def _run(loaded, **kw) -> list:
    request = GenerationRequest(prompt=tuple(PROMPT), **kw)
    return list(stream_generate(loaded.model, None, request, cache=KVCache(loaded.spec, 64)))


def test_greedy_stream_is_the_argmax_chain(tiny):
    events = _run(tiny, max_tokens=10)
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "length" and len(done.tokens) == 10
    cache = KVCache(tiny.spec, 64)
    logits = tiny.model.forward(PROMPT, cache)[-1]
    expected = []
    for _ in range(10):
        expected.append(int(logits.argmax()))
        logits = tiny.model.forward([expected[-1]], cache)[-1]
    assert list(done.tokens) == expected
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == expected
    assert done.stats.prompt_tokens == len(PROMPT) and done.stats.generated_tokens == 10


def test_stop_id_ends_generation_without_emitting_it(tiny):
    greedy = _run(tiny, max_tokens=8)[-1].tokens
    stop = greedy[4]
    first = greedy.index(stop)
    done = _run(tiny, max_tokens=8, stop_ids=frozenset({stop}))[-1]
    assert done.finish_reason == "stop" and done.tokens == greedy[:first]


def test_seeded_sampling_repeats_and_seeds_differ(tiny):
    params = lambda seed: SamplingParams(temperature=1.5, top_p=0.95, seed=seed)  # noqa: E731
    a = _run(tiny, max_tokens=16, sampling=params(1))[-1].tokens
    b = _run(tiny, max_tokens=16, sampling=params(1))[-1].tokens
    c = _run(tiny, max_tokens=16, sampling=params(2))[-1].tokens
    assert a == b and a != c


def test_cancel_stops_within_one_token(tiny):
    cancel = threading.Event()
    request = GenerationRequest(prompt=tuple(PROMPT), max_tokens=50)
    seen = 0
    stream = stream_generate(tiny.model, None, request, cache=KVCache(tiny.spec, 128), cancel=cancel)
    for event in stream:
        if isinstance(event, TokenEvent):
            seen += 1
            if seen == 3:
                cancel.set()
        if isinstance(event, DoneEvent):
            assert event.finish_reason == "cancelled" and len(event.tokens) == 3


def test_prompt_logits_event_and_progress(tiny):
    events = _run(tiny, max_tokens=2, prompt_logits=True)
    logits = next(e for e in events if isinstance(e, PromptLogitsEvent)).logits
    assert logits.shape == (len(PROMPT), tiny.spec.vocab_size)
    progress = [e for e in events if isinstance(e, ProgressEvent)]
    assert progress and progress[-1].done == progress[-1].total == len(PROMPT)
    # generation continues from the prompt's last row
    assert events[-1].tokens[0] == int(logits[-1].argmax())


def test_prompt_longer_than_context_is_an_error_with_numbers(tiny):
    request = GenerationRequest(prompt=tuple(PROMPT), max_tokens=4)
    events = list(stream_generate(tiny.model, None, request, cache=KVCache(tiny.spec, 8)))
    assert len(events) == 1 and isinstance(events[0], ErrorEvent)
    assert "12 tokens" in events[0].message and "8" in events[0].message


def test_generation_stops_at_a_full_context(tiny):
    done = list(stream_generate(tiny.model, None, GenerationRequest(prompt=tuple(PROMPT), max_tokens=100),
                                cache=KVCache(tiny.spec, 16)))[-1]
    assert done.finish_reason == "length" and len(done.tokens) == 16 - len(PROMPT) + 1


def test_out_of_vocabulary_token_is_an_error(tiny):
    events = list(stream_generate(tiny.model, None, GenerationRequest(prompt=(1, 10_000)), cache=KVCache(tiny.spec, 8)))
    assert isinstance(events[-1], ErrorEvent) and "10000" in events[-1].message


def test_bad_sampling_settings_are_an_error(tiny):
    request = GenerationRequest(prompt=tuple(PROMPT), sampling=SamplingParams(top_p=1.5))
    events = list(stream_generate(tiny.model, None, request, cache=KVCache(tiny.spec, 64)))
    assert isinstance(events[-1], ErrorEvent) and "top_p" in events[-1].message


def test_generate_step_runs_no_forward_after_the_consumer_stops(tiny):
    calls = []
    forward = tiny.model.forward

    def counting(*a, **kw):
        calls.append(1)
        return forward(*a, **kw)

    tiny.model.forward = counting
    try:
        steps = generate_step(tiny.model, PROMPT, KVCache(tiny.spec, 64), SamplingParams())
        [next(steps) for _ in range(3)]
        steps.close()
    finally:
        del tiny.model.forward
    assert len(calls) == 3  # the prefill and two decode steps: the third token needs no forward pass


@pytest.mark.parametrize(
    "pieces, stops, streamed, hit",
    [
        (["Hello", " wor", "ld"], ["\n\n"], "Hello world", False),
        (["The answer", " is 4", "2.\nUser", ": hi"], ["\nUser:"], "The answer is 42.", True),
        (["ab", "c", "d"], ["cde"], "ab", False),   # "cd" may start the stop string: held back
        (["x<|e", "nd|>y"], ["<|end|>"], "x", True),
        (["aaa"], ["aab"], "a", False),
    ],
)
def test_stop_strings(pieces, stops, streamed, hit):
    """Text that may begin a stop string is held back; a completed one cuts the text before it."""
    matcher = StopStrings(stops)
    out, got_hit = "", False
    for piece in pieces:
        text, got_hit = matcher.feed(piece)
        out += text
        if got_hit:
            break
    assert got_hit == hit and out == streamed
    if not hit:  # at the end, what was held back is released
        assert out + matcher.flush() == "".join(pieces)


def test_cancel_during_prefill_ends_before_any_token(tiny):
    """A long prompt is run in chunks; a cancel raised meanwhile stops before the next chunk."""
    cancel = threading.Event()
    cancel.set()
    prompt = tuple(int(t) for t in np.arange(300) % 150)
    events = list(stream_generate(tiny.model, None, GenerationRequest(prompt=prompt, max_tokens=5),
                                  cache=KVCache(tiny.spec, 512), cancel=cancel))
    assert [type(e) for e in events] == [ProgressEvent, DoneEvent]
    assert events[0].done == 256 and events[0].total == 300
    assert events[-1].finish_reason == "cancelled" and events[-1].tokens == ()
