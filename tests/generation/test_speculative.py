"""Speculative decoding changes how many forward passes run, never the tokens or the cache.

On 4-bit containers (row-invariant kernels) of a tiny dense model and a tiny MoE, drafting by
prompt lookup, by a draft model, by an oracle and by a drafter that is always wrong all give the
tokens plain decoding gives, greedy and seeded, and leave the cache holding the same tokens and
the same keys and values.
"""

from __future__ import annotations

import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.events import DoneEvent, ErrorEvent, TokenEvent
from engine.generation.generate import GenerationRequest, generate_step, stream_generate
from engine.generation.sampling import SamplingParams
from engine.generation.speculative import (
    DraftModel,
    PromptLookup,
    SpeculationController,
    SpeculativeSettings,
    verify,
)
from engine.kv import KVCache
from engine.loader import load_model
from support.drafters import Oracle
from support.reference import build_checkpoint

REPEATING = [5, 17, 99, 3, 42, 7, 150, 64, 11, 23] * 3        # prompt lookup finds n-grams to copy
PLAIN = list(range(3, 150, 7))                                 # no token twice
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
PENALIZED = SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.3, presence_penalty=0.4, seed=3)
SAMPLINGS = pytest.mark.parametrize("sampling", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalized"])
CTX = 128
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
           norm_topk_prob=True)


@pytest.fixture(scope="module", params=["llama", "qwen2_moe"])
def target(request, tmp_path_factory):
    """A 4-bit container of a tiny dense model, then of a tiny MoE."""
    extra = MOE if request.param == "qwen2_moe" else {}
    src = build_checkpoint(tmp_path_factory.mktemp("src"), request.param, **extra)
    out = convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None)
    return load_model(out)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A different tiny model with the same vocabulary: a draft model that is sometimes right."""
    src = build_checkpoint(tmp_path_factory.mktemp("draft"), "llama", seed=1, num_hidden_layers=2)
    return load_model(src)


class StepClock:
    """A clock read twice per step that makes every step take half a second, however many rows it verifies
    (so the controller's verdicts do not depend on the machine's load)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.5
        return self.now


def _generate(loaded, prompt, speculative=None, ctx=CTX, **kw):
    """(events, cache, controller) of one stream_generate run; the controller times steps with a StepClock."""
    cache = KVCache(loaded.spec, ctx)
    controller = SpeculationController(speculative, clock=StepClock()) if speculative is not None else None
    request = GenerationRequest(prompt=tuple(prompt), speculative=speculative, **kw)
    events = list(stream_generate(loaded.model, None, request, cache=cache, speculation=controller))
    return events, cache, controller


def _same_run(loaded, prompt, speculative, ctx=CTX, **kw):
    """Run plainly and speculatively; assert identical events and caches; return the controller."""
    plain, plain_cache, _ = _generate(loaded, prompt, None, ctx, **kw)
    spec, spec_cache, controller = _generate(loaded, prompt, speculative, ctx, **kw)
    assert isinstance(plain[-1], DoneEvent) and isinstance(spec[-1], DoneEvent)
    tokens = lambda events: [(e.index, e.token_id) for e in events if isinstance(e, TokenEvent)]  # noqa: E731
    assert tokens(spec) == tokens(plain)
    a, b = plain[-1], spec[-1]
    assert (b.tokens, b.text, b.finish_reason) == (a.tokens, a.text, a.finish_reason)
    assert b.stats.generated_tokens == a.stats.generated_tokens
    _same_cache(loaded, plain_cache, spec_cache)
    return controller, a


def _same_cache(loaded, a: KVCache, b: KVCache) -> None:
    """Same tokens and length, and the same keys and values: one more token gives the same logits."""
    assert (b.length, b.tokens) == (a.length, a.tokens)
    if a.length < a.max_len:
        np.testing.assert_array_equal(loaded.model.forward([1], b), loaded.model.forward([1], a))


def _plain_sequence(loaded, prompt, sampling, n):
    done = _generate(loaded, prompt, None, sampling=sampling, max_tokens=n)[0][-1]
    return list(prompt) + list(done.tokens)


# --------------------------------------------------------------------------- identical output


@SAMPLINGS
@pytest.mark.parametrize("prompt", [REPEATING, PLAIN], ids=["repeating", "plain"])
def test_prompt_lookup_gives_the_plain_tokens_and_cache(target, prompt, sampling):
    settings = SpeculativeSettings(max_draft=4, adaptive=False)
    controller, _ = _same_run(target, prompt, settings, sampling=sampling, max_tokens=40)
    assert controller.draft_steps > 0


@SAMPLINGS
def test_an_oracle_drafter_is_always_accepted_and_stays_on(target, sampling):
    sequence = _plain_sequence(target, REPEATING, sampling, 40)
    settings = SpeculativeSettings(max_draft=4, drafter=Oracle(sequence, target.spec.vocab_size))
    controller, _ = _same_run(target, REPEATING, settings, sampling=sampling, max_tokens=40)
    assert controller.accepted == controller.drafted > 0
    assert controller.on and controller.switches == 0
    assert controller.steps < 39 / 2          # most steps produce k + 1 tokens


def test_an_always_wrong_drafter_is_switched_off(target):
    sequence = _plain_sequence(target, REPEATING, GREEDY, 40)
    settings = SpeculativeSettings(max_draft=4, warmup=3, retry_after=100,
                                   drafter=Oracle(sequence, target.spec.vocab_size, wrong=True))
    controller, _ = _same_run(target, REPEATING, settings, max_tokens=40)
    assert controller.accepted == 0 and not controller.on and controller.switches == 1
    assert controller.draft_steps == 3        # the warmup, then plain decoding until retry_after


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_model_itself_as_draft_model(target, sampling):
    """Greedy drafts of the same weights: all accepted under greedy, partly under sampling (rollbacks)."""
    settings = SpeculativeSettings(max_draft=3, lookup=False, draft_model=target.model, adaptive=False)
    controller, _ = _same_run(target, PLAIN, settings, sampling=sampling, max_tokens=30)
    assert controller.drafted > 0
    if sampling is GREEDY:
        assert controller.accepted == controller.drafted
    else:
        assert controller.accepted < controller.drafted


def test_a_small_draft_model_with_the_same_vocabulary(target, small):
    settings = SpeculativeSettings(max_draft=3, draft_model=small.model, adaptive=False)
    for sampling in (GREEDY, SEEDED):
        controller, _ = _same_run(target, PLAIN, settings, sampling=sampling, max_tokens=30)
        assert controller.drafted > 0


# --------------------------------------------------------------------------- stops and limits


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 13])
def test_max_tokens_falls_inside_a_draft(target, max_tokens):
    sequence = _plain_sequence(target, REPEATING, GREEDY, 20)
    settings = SpeculativeSettings(max_draft=4, drafter=Oracle(sequence, target.spec.vocab_size))
    _, done = _same_run(target, REPEATING, settings, max_tokens=max_tokens)
    assert len(done.tokens) == max_tokens


@pytest.mark.parametrize("at", [1, 2, 5])
def test_a_stop_id_inside_an_accepted_draft(target, at):
    sequence = _plain_sequence(target, REPEATING, GREEDY, 20)
    generated = sequence[len(REPEATING):]
    stop = generated[at]
    settings = SpeculativeSettings(max_draft=4, drafter=Oracle(sequence, target.spec.vocab_size))
    _, done = _same_run(target, REPEATING, settings, max_tokens=20, stop_ids=frozenset({stop}))
    assert done.finish_reason == "stop" and len(done.tokens) == generated.index(stop)


def test_a_full_context_ends_where_plain_decoding_ends(target):
    sequence = _plain_sequence(target, PLAIN, GREEDY, 19)
    settings = SpeculativeSettings(max_draft=4, drafter=Oracle(sequence, target.spec.vocab_size))
    _, done = _same_run(target, PLAIN, settings, ctx=32, max_tokens=100)
    assert done.finish_reason == "length" and len(done.tokens) == 32 - len(PLAIN) + 1


def test_a_consumer_stopping_mid_draft_leaves_the_plain_cache(target):
    """Whatever token the consumer stops at, the cache holds what plain decoding holds there."""
    sequence = _plain_sequence(target, REPEATING, GREEDY, 12)
    for stop_after in range(1, 12):
        caches = []
        for drafter in (None, Oracle(sequence, target.spec.vocab_size)):
            cache = KVCache(target.spec, CTX)
            settings = SpeculativeSettings(max_draft=4, drafter=drafter) if drafter else None
            steps = generate_step(target.model, REPEATING, cache, GREEDY, speculative=settings)
            got = [next(steps) for _ in range(stop_after)]
            steps.close()
            assert got == sequence[len(REPEATING) : len(REPEATING) + stop_after]
            caches.append(cache)
        _same_cache(target, *caches)


def test_bad_settings_are_an_error_event(target):
    request = GenerationRequest(prompt=tuple(PLAIN), speculative=SpeculativeSettings(max_draft=0))
    events = list(stream_generate(target.model, None, request, cache=KVCache(target.spec, CTX)))
    assert isinstance(events[-1], ErrorEvent) and "max_draft" in events[-1].message


# --------------------------------------------------------------------------- the pieces


@pytest.mark.parametrize(
    "context, kw, k, want",
    [
        ([1, 2, 3, 4, 9, 1, 2, 3], {}, 4, [4, 9, 1, 2]),            # what followed the trigram
        ([1, 2, 5, 1, 2, 6, 1, 2], dict(max_ngram=2), 2, [6, 1]),   # the most recent occurrence wins
        ([7, 2, 8, 1, 2, 9, 7, 2], dict(max_ngram=2), 1, [8]),      # the longest n-gram first
        ([7, 2, 8, 1, 2, 9, 6, 2], dict(max_ngram=2), 1, [9]),      # ... else a shorter one
        ([1, 5, 2, 1], dict(min_ngram=2), 3, []),                   # unigrams not allowed
        ([3, 1, 4, 1, 5], {}, 3, []),                               # nothing repeats
        ([4, 4, 4], {}, 4, [4, 4, 4, 4]),                           # a run continues past the end
        ([1, 2, 1, 2], {}, 5, [1, 2, 1, 2]),                        # capped at max_draft
        ([1, 2, 3, 1, 2, 3], {}, 0, []),
        ([9], {}, 3, []),
    ],
)
def test_prompt_lookup_proposals(context, kw, k, want):
    assert PromptLookup(**kw, max_draft=4).propose(np.array(context), k) == want


def test_verify_stops_at_the_first_mismatch_and_samples_once_per_token():
    rows = np.eye(6, dtype=np.float32)[[3, 4, 0, 5]]     # row j's argmax: 3, 4, 0, 5
    calls = []

    def choose(row):
        calls.append(1)
        return int(np.argmax(row))

    assert verify(rows, [3, 4, 1], choose) == [3, 4, 0] and len(calls) == 3
    assert verify(rows, [3, 4, 0], choose) == [3, 4, 0, 5]                 # all accepted: the bonus token
    assert verify(rows[:1], [], choose) == [3]


def test_draft_model_follows_the_context_and_rolls_back(small):
    drafter = DraftModel(small.model)
    model = small.model

    def greedy(context, k):
        cache = KVCache(small.spec, CTX)
        logits, out = model.forward(context, cache)[-1], []
        for _ in range(k):
            out.append(int(np.argmax(logits)))
            logits = model.forward([out[-1]], cache)[-1]
        return out

    first = drafter.propose(np.array(PLAIN), 3)
    assert first == greedy(PLAIN, 3)
    assert drafter.cache.tokens == PLAIN + first[:2]
    other = PLAIN + [first[0], (first[1] + 1) % small.spec.vocab_size]   # one draft token accepted, one rejected
    second = drafter.propose(np.array(other), 3)
    assert second == greedy(other, 3)
    assert drafter.cache.tokens == other + second[:2]
    assert drafter.propose(np.array(other), 10_000) == []       # past the draft model's context: no guess
    drafter.close()


def _feed(controller, steps, drafted, accepted, draft_s, plain_s) -> str:
    """Drive the controller as the decode loop does, with made-up timings; the steps as D (draft) and P (plain)."""
    trace = ""
    for _ in range(steps):
        if controller.want_draft():
            controller.record(drafted, accepted, accepted + 1, draft_s)
            trace += "D"
        else:
            controller.record(0, 0, 1, plain_s)
            trace += "P"
    return trace


def test_controller_stays_on_while_drafting_pays():
    c = SpeculationController(SpeculativeSettings())
    trace = _feed(c, 100, 4, 3, draft_s=0.012, plain_s=0.010)     # 4 tokens in 12 ms against 1 in 10 ms
    assert c.on and c.switches == 0 and c.acceptance == 0.75
    assert trace.startswith("DPDDD") and trace.count("P") == 7      # one probe in 16 keeps the baseline fresh


def test_controller_switches_off_when_drafts_are_accepted_but_verifying_costs_more():
    """The streamed-MoE case: each verify pass reads so many more experts that accepted drafts do not pay."""
    c = SpeculationController(SpeculativeSettings(warmup=4, retry_after=32))
    trace = _feed(c, 211, 4, 1, draft_s=0.050, plain_s=0.010)     # 2 tokens in 50 ms against 1 in 10 ms
    trial = "DPDDD"                                                 # the verdict comes after 4 drafting steps
    assert trace == trial + "P" * 32 + trial + "P" * 64 + trial + "P" * 100   # each failed try doubles the wait
    assert not c.on and c.switches == 3 and c.accepted == 12


def test_controller_switches_off_on_zero_acceptance_and_back_on_when_drafts_pay():
    c = SpeculationController(SpeculativeSettings(warmup=4, retry_after=8))
    assert _feed(c, 10, 4, 0, draft_s=0.011, plain_s=0.010) == "DPDDD" + "P" * 5
    assert not c.on and c.accepted == 0
    assert _feed(c, 40, 4, 4, draft_s=0.011, plain_s=0.010).startswith("PPPDPDDDD")
    assert c.on and c.switches == 1


def test_controller_without_adaptation_always_drafts():
    c = SpeculationController(SpeculativeSettings(adaptive=False))
    _feed(c, 50, 4, 0, draft_s=0.1, plain_s=0.01)
    assert c.on and c.draft_steps == 50 and c.as_dict()["acceptance"] == 0.0


def test_colibri_run_speculative_prints_the_plain_answer_and_the_counters(target, capsys):
    import json

    from app.cli import main

    args = ["run", str(target.path), "--tokens", ",".join(map(str, [5, 6, 7, 5, 6, 7, 5, 6])), "--max-tokens", "12",
            "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--speculative", "--draft", "3"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["tokens"] == plain["tokens"] and fast["speculative"]["steps"] >= 1
    assert main(args + ["--draft-model", str(target.path)]) != 0
    assert "--draft-model needs --speculative" in capsys.readouterr().err
