"""Batching: sequences decoded together give exactly the tokens they give alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.events import DoneEvent, ErrorEvent, ProgressEvent, TokenEvent
from engine.generation.generate import GenerationRequest, stream_generate
from engine.generation.sampling import SamplingParams
from engine.generation.scheduler import Scheduler
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from support.families import FAMILIES
from support.reference import build_checkpoint

PROMPTS = [
    [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23],
    [5, 17, 99, 3, 42, 42, 7, 150, 9, 31],                     # shares a prefix with the first
    [120, 6, 18, 44, 2, 90, 71, 33, 8, 101, 19, 60, 2, 77, 140, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
    [7],
]


@pytest.fixture(scope="module", params=["mixtral", "deepseek_v3", "llama"])
def tiny(request, tmp_path_factory):
    model_type, overrides = FAMILIES.get(request.param, (request.param, {}))     # llama: dense, fused batch step
    src = build_checkpoint(tmp_path_factory.mktemp(request.param), model_type, **overrides)
    return load_model(convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None))


def _alone(loaded, prompt, sampling, max_tokens=10) -> DoneEvent:
    request = GenerationRequest(prompt=tuple(prompt), max_tokens=max_tokens, sampling=sampling)
    return list(stream_generate(loaded.model, None, request, cache=KVCache(loaded.spec, 64)))[-1]


def _events(seq) -> list:
    return list(seq.drain())


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.9, seed=3),
                                      SamplingParams(temperature=0.0, frequency_penalty=1.5, repetition_penalty=1.2)])
def test_batched_equals_sequential(tiny, sampling):
    want = [_alone(tiny, p, sampling).tokens for p in PROMPTS]
    sched = Scheduler(tiny.model, KVPool(tiny.spec, 64, block_size=4), max_len=64, prefill_chunk=8)
    seqs = [sched.submit(GenerationRequest(prompt=tuple(p), max_tokens=10, sampling=sampling)) for p in PROMPTS]
    sched.run()
    got = [[e for e in _events(s) if isinstance(e, DoneEvent)][0].tokens for s in seqs]
    assert got == want
    assert sched.steps < sum(10 + -(-len(p) // 8) for p in PROMPTS)    # really batched
    assert sched.pool.used_blocks == 0                                  # every sequence gave its blocks back


def test_requests_join_between_steps_and_long_prompts_are_chunked(tiny):
    greedy = SamplingParams(temperature=0.0)
    sched = Scheduler(tiny.model, KVPool(tiny.spec, 64, block_size=4), max_len=64, prefill_chunk=4)
    first = sched.submit(GenerationRequest(prompt=tuple(PROMPTS[0]), max_tokens=12, sampling=greedy))
    for _ in range(5):                                   # 3 prompt chunks, then decoding
        sched.step()
    assert first.pending is not None
    late = sched.submit(GenerationRequest(prompt=tuple(PROMPTS[2]), max_tokens=4, sampling=greedy))
    decoded_while_prefilling = 0
    while late.pending is None and not late.done:
        before = len(first.tokens)
        sched.step()
        decoded_while_prefilling += len(first.tokens) - before
    assert decoded_while_prefilling >= 5                 # the 25-token prompt went in 4-token chunks beside decoding
    sched.run()
    progress = [e for e in _events(late) if isinstance(e, ProgressEvent)]
    assert [p.done for p in progress] == [4, 8, 12, 16, 20, 24, 25]
    assert [e for e in _events(first) if isinstance(e, DoneEvent)][0].tokens == _alone(tiny, PROMPTS[0], greedy, 12).tokens


def test_a_shared_prefix_is_computed_once(tiny):
    pool = KVPool(tiny.spec, 64, block_size=4)
    sched = Scheduler(tiny.model, pool, max_len=64)
    a = sched.submit(GenerationRequest(prompt=tuple(PROMPTS[0]), max_tokens=2))
    sched.run()
    b = sched.submit(GenerationRequest(prompt=tuple(PROMPTS[1]), max_tokens=2))
    sched.run()
    assert a.reused == 0 and b.reused == 8               # two full blocks of the common 8 tokens
    assert [e for e in _events(b) if isinstance(e, DoneEvent)][0].tokens == \
        _alone(tiny, PROMPTS[1], SamplingParams(), 2).tokens


def test_cancel_and_errors_leave_the_others_running(tiny):
    sched = Scheduler(tiny.model, KVPool(tiny.spec, 64, block_size=4), max_len=32)
    cancel = threading.Event()
    a = sched.submit(GenerationRequest(prompt=tuple(PROMPTS[0]), max_tokens=20), cancel)
    bad = sched.submit(GenerationRequest(prompt=(5, 999), max_tokens=3))      # outside the vocabulary
    long = sched.submit(GenerationRequest(prompt=tuple(range(1, 40)), max_tokens=3))
    c = sched.submit(GenerationRequest(prompt=tuple(PROMPTS[3]), max_tokens=3))
    sched.step()
    sched.step()
    cancel.set()
    sched.run()
    failed = _events(bad)[-1]
    assert isinstance(failed, ErrorEvent) and "outside the vocabulary" in failed.message
    assert [e for e in _events(long) if isinstance(e, ErrorEvent)][0].message.startswith("the prompt has 39 tokens")
    assert [e for e in _events(a) if isinstance(e, DoneEvent)][0].finish_reason == "cancelled"
    assert [e for e in _events(c) if isinstance(e, DoneEvent)][0].finish_reason == "length"
    assert sched.pool.used_blocks == 0


def test_tokens_stream_as_events(tiny):
    sched = Scheduler(tiny.model, KVPool(tiny.spec, 64), max_len=64)
    seq = sched.submit(GenerationRequest(prompt=tuple(PROMPTS[0]), max_tokens=4))
    sched.run()
    events = _events(seq)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [t.index for t in tokens] == [0, 1, 2, 3]
    assert isinstance(events[-1], DoneEvent) and events[-1].tokens == tuple(t.token_id for t in tokens)
    assert np.isfinite(events[-1].stats.ttft_s)


def _tokens(seq) -> tuple[int, ...]:
    return [e for e in _events(seq) if isinstance(e, DoneEvent)][0].tokens


def _prefilled_per_step(sched, seqs) -> list[list[int]]:
    """Step until every sequence has its prompt in the cache; per step, the prompt tokens each one had then."""
    per_step = []
    while any(s.pending is None and not s.done for s in seqs):
        sched.step()
        per_step.append([s.prefilled for s in seqs])
    return per_step


def test_waiting_prompts_of_different_lengths_prefill_together(tiny):
    """Prompts waiting together share one pass per step, a chunk's worth of tokens in all, taken in the order they
    came (the last to fit gets a piece of its prompt); each sequence's greedy tokens are its solo ones."""
    greedy = SamplingParams(temperature=0.0)
    sched = Scheduler(tiny.model, KVPool(tiny.spec, 64, block_size=4), max_len=64, prefill_chunk=16)
    seqs = [sched.submit(GenerationRequest(prompt=tuple(p), max_tokens=6, sampling=greedy)) for p in PROMPTS]
    steps = _prefilled_per_step(sched, seqs)
    assert steps[0] == [12, 4, 0, 0]           # 16 prompt tokens: the first prompt and 4 of the second
    assert steps[1] == [12, 10, 10, 0]         # the second's 6 left, then 10 of the third
    assert steps[2] == [12, 10, 25, 1]         # the third's 15 left and the fourth's 1
    assert len(steps) == 3                     # 48 prompt tokens in 16-token steps, beside the decoding rows
    sched.run()
    assert [_tokens(s) for s in seqs] == [_alone(tiny, p, greedy, 6).tokens for p in PROMPTS]
    assert sched.pool.used_blocks == 0


def test_prompts_joining_mid_batch_prefill_together_beside_decoding(tiny):
    greedy = SamplingParams(temperature=0.0)
    sched = Scheduler(tiny.model, KVPool(tiny.spec, 64, block_size=4), max_len=64, prefill_chunk=8)
    first = sched.submit(GenerationRequest(prompt=tuple(PROMPTS[3]), max_tokens=14, sampling=greedy))
    sched.step()
    sched.step()
    assert len(first.tokens) == 2
    late = [sched.submit(GenerationRequest(prompt=tuple(p), max_tokens=5, sampling=greedy)) for p in PROMPTS[1:3]]
    steps = _prefilled_per_step(sched, late)
    assert steps[:2] == [[8, 0], [10, 6]]      # the second ends its prompt and the third starts in the same pass
    assert len(steps) == 5 and len(first.tokens) == 7      # 35 prompt tokens in 8-token steps; the first decodes on
    sched.run()
    assert _tokens(first) == _alone(tiny, PROMPTS[3], greedy, 14).tokens
    assert [_tokens(s) for s in late] == [_alone(tiny, p, greedy, 5).tokens for p in PROMPTS[1:3]]


def test_prompts_reusing_a_cached_prefix_prefill_together(tiny):
    """A prompt that starts from cached blocks prefills only its rest, in the same pass as a fresh one."""
    greedy = SamplingParams(temperature=0.0)
    sched = Scheduler(tiny.model, KVPool(tiny.spec, 64, block_size=4), max_len=64, prefill_chunk=32)
    sched.submit(GenerationRequest(prompt=tuple(PROMPTS[0]), max_tokens=2, sampling=greedy))
    sched.run()
    seqs = [sched.submit(GenerationRequest(prompt=tuple(p), max_tokens=6, sampling=greedy)) for p in PROMPTS[1:3]]
    steps = _prefilled_per_step(sched, seqs)
    assert [s.reused for s in seqs] == [8, 0]
    assert steps == [[10, 25]]                 # the second's 2 uncached tokens and the whole third in one pass
    sched.run()
    assert [_tokens(s) for s in seqs] == [_alone(tiny, p, greedy, 6).tokens for p in PROMPTS[1:3]]


def test_steps_that_only_decode_are_counted_apart_from_prompt_chunks(tiny):
    """The bench judges a batch's decode by these counts: a step with a prompt chunk in it is not a decode step."""
    greedy = SamplingParams(temperature=0.0)
    sched = Scheduler(tiny.model, KVPool(tiny.spec, 64, block_size=4), max_len=64, prefill_chunk=4)
    first = sched.submit(GenerationRequest(prompt=tuple(PROMPTS[0]), max_tokens=12, sampling=greedy))
    for _ in range(3):                                   # the 12-token prompt in 3 chunks
        sched.step()
    assert sched.decode_steps == 0 and first.pending is not None
    for _ in range(2):
        sched.step()
    assert (sched.decode_steps, sched.decode_rows) == (2, 2) and sched.decode_seconds > 0
    sched.submit(GenerationRequest(prompt=tuple(PROMPTS[2]), max_tokens=3, sampling=greedy))
    for _ in range(7):                                   # its 25 tokens in 7 chunks, beside the first's decoding
        sched.step()
    assert sched.decode_steps == 2
    sched.step()                                         # both decode
    assert (sched.decode_steps, sched.decode_rows) == (3, 4)
