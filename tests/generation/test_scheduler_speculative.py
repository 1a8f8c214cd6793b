"""Speculative decoding inside the scheduler: each sequence drafts on its own and gives exactly the tokens, text and
cache that plain decoding in the scheduler gives (tests/generation/test_scheduler.py holds that against
stream_generate), alone or batched with others, greedy or seeded, under a grammar, with a drafter that is always
right and one that is always wrong."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.events import DoneEvent, ErrorEvent, TokenEvent
from engine.generation.generate import GenerationRequest
from engine.generation.grammar import json_schema_grammar
from engine.generation.sampling import SamplingParams
from engine.generation.scheduler import Scheduler
from engine.generation.speculative import SpeculativeSettings
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from support.drafters import Oracle
from support.reference import build_checkpoint
from support.tiny_chat import tiny_moe

REPEATING = [5, 17, 99, 3, 42, 7, 150, 64, 11, 23] * 3        # prompt lookup finds n-grams to copy
PLAIN = list(range(3, 150, 7))                                 # no token twice
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
PENALIZED = SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.3, presence_penalty=0.4, seed=3)
SAMPLINGS = pytest.mark.parametrize("sampling", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalized"])
CTX = 128
LOOKUP = SpeculativeSettings(max_draft=4, adaptive=False)     # drafts whenever lookup finds a match
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 4-bit container of a tiny dense model (row-invariant kernels: a draft row's logits equal a lone token's)."""
    src = build_checkpoint(tmp_path_factory.mktemp("src"), "llama")
    return load_model(convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None))


def _plain(loaded, request: GenerationRequest, tokenizer=None, stop_ids=frozenset()) -> tuple[list, KVCache]:
    """The events of the request decoded plainly, alone in a scheduler, and the cache it leaves."""
    sched = Scheduler(loaded.model, KVPool(loaded.spec, 40, block_size=8), max_len=CTX, tokenizer=tokenizer,
                      stop_ids=stop_ids)
    cache = KVCache(loaded.spec, CTX, pool=sched.pool)
    seq = sched.submit(GenerationRequest(**{**request.__dict__, "speculative": None}), cache=cache, keep=True)
    sched.run()
    return list(seq.drain()), cache


class StepClock:
    """A clock read twice per step that makes every step take half a second, however many rows it verifies
    (so the controllers' verdicts do not depend on the machine's load)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.25
        return self.now


def _scheduler(loaded, **kw) -> Scheduler:
    return Scheduler(loaded.model, KVPool(loaded.spec, 96, block_size=8), max_len=CTX, prefill_chunk=8,
                     clock=StepClock(), **kw)


def _tokens(events) -> list[tuple[int, int]]:
    return [(e.index, e.token_id) for e in events if isinstance(e, TokenEvent)]


def _same(loaded, requests: list[GenerationRequest], keep: bool = False, **kw) -> Scheduler:
    """Run the requests batched in one scheduler; assert each gives its plain solo events (and cache, when kept)."""
    sched = _scheduler(loaded, **kw)
    seqs = [sched.submit(r, cache=KVCache(loaded.spec, CTX, pool=sched.pool) if keep else None, keep=keep)
            for r in requests]
    sched.run()
    for request, seq in zip(requests, seqs):
        want, cache = _plain(loaded, request, kw.get("tokenizer"), kw.get("stop_ids", frozenset()))
        got = list(seq.drain())
        assert isinstance(got[-1], DoneEvent), got[-1]
        assert _tokens(got) == _tokens(want)
        a, b = want[-1], got[-1]
        assert (b.tokens, b.text, b.finish_reason) == (a.tokens, a.text, a.finish_reason)
        assert b.stats.generated_tokens == a.stats.generated_tokens
        if keep:    # the cache holds what plain decoding leaves: the same tokens, keys and values
            assert (seq.cache.length, seq.cache.tokens) == (cache.length, cache.tokens)
            np.testing.assert_array_equal(loaded.model.forward([1], seq.cache), loaded.model.forward([1], cache))
            seq.cache.release()
    assert sched.pool.used_blocks == 0
    return sched


@SAMPLINGS
@pytest.mark.parametrize("prompt", [REPEATING, PLAIN], ids=["repeating", "plain"])
def test_a_speculative_sequence_alone_gives_the_plain_tokens_and_cache(target, prompt, sampling):
    sched = _same(target, [GenerationRequest(prompt=tuple(prompt), max_tokens=24, sampling=sampling,
                                             speculative=LOOKUP)], keep=True)
    if prompt is REPEATING:
        assert sched.drafting.drafted > 0 and sched.drafting.draft_steps > 0
    assert sched.drafting.sequences == 1


@SAMPLINGS
def test_batched_sequences_draft_each_on_their_own(target, sampling):
    requests = [
        GenerationRequest(prompt=tuple(REPEATING), max_tokens=20, sampling=sampling, speculative=LOOKUP),
        GenerationRequest(prompt=tuple(PLAIN), max_tokens=16, sampling=sampling),                    # plain beside
        GenerationRequest(prompt=tuple(REPEATING[3:] + [9, 9, 9]), max_tokens=12, sampling=sampling,
                          speculative=SpeculativeSettings(max_draft=2, adaptive=False)),
        GenerationRequest(prompt=tuple([7] * 20), max_tokens=18, sampling=sampling, speculative=LOOKUP),
    ]
    sched = _same(target, requests, keep=True)
    assert sched.drafting.sequences == 3 and sched.drafting.drafted > 0
    assert sched.steps < sum(r.max_tokens for r in requests)        # batched, and some steps made several tokens


def test_a_prompt_chunk_beside_drafting_sequences(target):
    # the long prompt joins while the others draft: its chunks run apart from their verification rows
    requests = [GenerationRequest(prompt=tuple(REPEATING), max_tokens=30, speculative=LOOKUP),
                GenerationRequest(prompt=tuple(PLAIN * 3), max_tokens=8, speculative=LOOKUP)]
    _same(target, requests)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_an_always_right_drafter_is_accepted_and_stays_on(target, sampling):
    events, _ = _plain(target, GenerationRequest(prompt=tuple(PLAIN), max_tokens=30, sampling=sampling))
    plain = list(PLAIN) + list(events[-1].tokens)
    oracle = Oracle(plain, target.spec.vocab_size)
    request = GenerationRequest(prompt=tuple(PLAIN), max_tokens=30, sampling=sampling,
                                speculative=SpeculativeSettings(max_draft=4, drafter=oracle))
    sched = _same(target, [request], keep=True)
    d = sched.drafting
    assert d.drafted > 0 and d.accepted == d.drafted and d.switches == 0
    assert d.produced >= 3 * d.draft_steps              # most steps made k + 1 tokens


def test_an_always_wrong_drafter_is_switched_off_and_changes_nothing(target):
    events, _ = _plain(target, GenerationRequest(prompt=tuple(PLAIN), max_tokens=40, sampling=SEEDED))
    wrong = Oracle(list(PLAIN) + list(events[-1].tokens), target.spec.vocab_size, wrong=True)
    request = GenerationRequest(prompt=tuple(PLAIN), max_tokens=40, sampling=SEEDED,
                                speculative=SpeculativeSettings(max_draft=3, drafter=wrong, warmup=4, retry_after=64))
    sched = _same(target, [request], keep=True)
    d = sched.drafting
    assert d.accepted == 0 and d.switches == 1
    assert d.draft_steps <= 4                   # off after its warm-up, not tried again within 40 tokens


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_and_the_context_end_inside_a_draft(target, max_tokens):
    events, _ = _plain(target, GenerationRequest(prompt=tuple(PLAIN), max_tokens=max_tokens))
    oracle = Oracle(list(PLAIN) + list(events[-1].tokens) + [0] * 8, target.spec.vocab_size)
    request = GenerationRequest(prompt=tuple(PLAIN), max_tokens=max_tokens,
                                speculative=SpeculativeSettings(max_draft=4, drafter=oracle))
    _same(target, [request], keep=True)
    near_end = GenerationRequest(prompt=tuple(REPEATING * 4)[: CTX - 6], max_tokens=50, speculative=LOOKUP)
    _same(target, [near_end], keep=True)


def test_a_stop_id_inside_an_accepted_draft(target):
    events, _ = _plain(target, GenerationRequest(prompt=tuple(PLAIN), max_tokens=12))
    plain = list(PLAIN) + list(events[-1].tokens)
    stop = frozenset({plain[len(PLAIN) + 5]})
    oracle = Oracle(plain, target.spec.vocab_size)
    request = GenerationRequest(prompt=tuple(PLAIN), max_tokens=12, stop_ids=stop,
                                speculative=SpeculativeSettings(max_draft=4, drafter=oracle))
    _same(target, [request], keep=True)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tiny MoE with a tokenizer (grammars read token texts)."""
    src = tiny_moe(tmp_path_factory.mktemp("moe"))
    return load_model(convert(src, tmp_path_factory.mktemp("c") / "tiny", ConvertSettings(bits=4), log=lambda m: None))


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.9, seed=2)], ids=["greedy", "seeded"])
def test_drafts_under_a_grammar_batched_give_the_plain_json(chat, sampling):
    prompt = (5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8)
    spec = SpeculativeSettings(max_draft=4, adaptive=False)
    requests = [GenerationRequest(prompt=prompt, max_tokens=80, sampling=sampling, speculative=spec,
                                  grammar=json_schema_grammar(PERSON)),
                GenerationRequest(prompt=prompt[:6], max_tokens=20, sampling=sampling, speculative=spec)]
    sched = Scheduler(chat.model, KVPool(chat.spec, 96, block_size=8), max_len=CTX, tokenizer=chat.tokenizer,
                      stop_ids=chat.stop_ids)
    seqs = [sched.submit(r) for r in requests]
    sched.run()
    texts = []
    for request, seq in zip(requests, seqs):
        want, _ = _plain(chat, request, chat.tokenizer, chat.stop_ids)
        got = [e for e in seq.drain() if isinstance(e, (DoneEvent, ErrorEvent))][-1]
        assert isinstance(got, DoneEvent), got
        assert (got.tokens, got.text) == (want[-1].tokens, want[-1].text)
        texts.append(got.text)
    assert sched.drafting.drafted > 0
    jsonschema.validate(json.loads(texts[0]), PERSON)


def test_bad_speculative_settings_fail_the_request_alone(target):
    sched = _scheduler(target)
    bad = sched.submit(GenerationRequest(prompt=(1, 2, 3), speculative=SpeculativeSettings(max_draft=0)))
    good = sched.submit(GenerationRequest(prompt=(1, 2, 3), max_tokens=3, speculative=LOOKUP))
    sched.run()
    assert isinstance(list(bad.drain())[-1], ErrorEvent)
    assert isinstance(list(good.drain())[-1], DoneEvent)
