"""A lazy tool-call grammar (tool_choice "auto") on a real tiny model, through the engine's decoding loops: a logit
bias makes the model open `<tool_call>` whenever the text is free, so it writes call after call; every call it
closes validates, where the same model unconstrained writes no valid call. Batched with other sequences and with
speculative drafts, the tokens are the ones plain solo decoding gives."""

from __future__ import annotations

from dataclasses import replace

import jsonschema
import pytest

from engine.events import DoneEvent, ErrorEvent
from engine.generation.call_grammar import call_grammar
from engine.generation.generate import GenerationRequest, stream_generate
from engine.generation.sampling import SamplingParams
from engine.generation.scheduler import Scheduler
from engine.generation.speculative import SpeculationController, SpeculativeSettings
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from engine.tokenizer.tool_calls import parse_tool_calls
from support.scripted import qwen_chat_model

CTX = 512
SCHEMAS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 3}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}
PROMPT = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    loaded = load_model(qwen_chat_model(tmp_path_factory.mktemp("qwen") / "tiny"))
    yield loaded
    loaded.close()


def _request(tiny, sampling: SamplingParams, grammar: bool = True, **kw) -> GenerationRequest:
    tok = tiny.tokenizer
    opener = tok.token_to_id("<tool_call>")
    lazy = call_grammar("hermes", SCHEMAS, list(SCHEMAS), lambda m: None, forced=False) if grammar else None
    biased = replace(sampling, logit_bias=((opener, 100.0),))
    return GenerationRequest(prompt=tuple(tok.encode(PROMPT, add_special_tokens=False)), max_tokens=200,
                             sampling=biased, grammar=lazy, skip_special_tokens=False, **kw)


def _alone(tiny, request, **kw) -> DoneEvent:
    done = list(stream_generate(tiny.model, tiny.tokenizer, request, stop_ids=tiny.stop_ids,
                                cache=KVCache(tiny.spec, CTX), **kw))[-1]
    assert isinstance(done, DoneEvent), done
    return done


GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, seed=3)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED])
def test_every_call_the_model_closes_validates(tiny, sampling):
    done = _alone(tiny, _request(tiny, sampling))
    _, calls = parse_tool_calls("hermes", done.text, SCHEMAS)
    assert done.text.count("</tool_call>") >= 2 and len(calls) >= 2, done.text      # free again after each call
    for call in calls:
        jsonschema.validate(call.arguments, SCHEMAS[call.name])
    loose = _alone(tiny, _request(tiny, sampling, grammar=False))
    assert parse_tool_calls("hermes", loose.text, SCHEMAS)[1] == []


def test_batched_and_speculative_decoding_give_the_solo_tokens(tiny):
    requests = [_request(tiny, GREEDY), _request(tiny, SAMPLED),
                GenerationRequest(prompt=(5, 6, 7), max_tokens=30, sampling=GREEDY)]
    want = [_alone(tiny, r).tokens for r in requests]
    sched = Scheduler(tiny.model, KVPool(tiny.spec, CTX, block_size=8), max_len=CTX, tokenizer=tiny.tokenizer,
                      stop_ids=tiny.stop_ids)
    seqs = [sched.submit(r) for r in requests]
    sched.run()
    got = [[e for e in s.drain() if isinstance(e, (DoneEvent, ErrorEvent))][-1] for s in seqs]
    assert [g.tokens for g in got] == want
    assert sched.steps < sum(len(w) + 1 for w in want)      # really batched

    settings = SpeculativeSettings(max_draft=4, adaptive=False, min_ngram=1)
    controller = SpeculationController(settings)
    spec = _alone(tiny, _request(tiny, GREEDY, speculative=settings), speculation=controller)
    assert spec.tokens == want[0] and controller.drafted > 0
