"""Grammar-constrained decoding (engine.generation.grammar) inside the sampler chain: batched sequences each follow
their own grammar and give what they give alone; speculative decoding verifies drafts against the constraint and
gives what plain decoding gives; a model whose own choices are no JSON produces valid JSON, greedy and sampled."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.errors import GenerationError
from engine.events import DoneEvent, ErrorEvent
from engine.generation.generate import GenerationRequest, stream_generate
from engine.generation.grammar import json_object_grammar, json_schema_grammar, make_constraint
from engine.generation.sampling import SamplingParams
from engine.generation.scheduler import Scheduler
from engine.generation.speculative import SpeculationController, SpeculativeSettings
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from support.tiny_chat import tiny_moe

CTX = 256
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 999}},
          "required": ["name", "ok", "n"], "additionalProperties": False}
LIST = {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1, "maxItems": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    src = tiny_moe(tmp_path_factory.mktemp("moe"))
    return load_model(convert(src, tmp_path_factory.mktemp("c") / "tiny", ConvertSettings(bits=4), log=lambda m: None))


def _request(prompt, schema, sampling, max_tokens=120, **kw) -> GenerationRequest:
    return GenerationRequest(prompt=tuple(prompt), max_tokens=max_tokens, sampling=sampling,
                             grammar=json_schema_grammar(schema), **kw)


def _alone(tiny, request) -> DoneEvent:
    done = list(stream_generate(tiny.model, tiny.tokenizer, request, stop_ids=tiny.stop_ids,
                                cache=KVCache(tiny.spec, CTX)))[-1]
    assert isinstance(done, DoneEvent), done
    return done


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.95, seed=5)])
def test_batched_sequences_follow_their_own_grammar_as_alone(tiny, sampling):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    schemas = [PERSON, LIST, None]          # the last one is free text beside them
    requests = [_request(p, s, sampling) if s else GenerationRequest(prompt=tuple(p), max_tokens=30, sampling=sampling)
                for p, s in zip(prompts, schemas)]
    want = [_alone(tiny, r) for r in requests]
    sched = Scheduler(tiny.model, KVPool(tiny.spec, CTX, block_size=8), max_len=CTX, tokenizer=tiny.tokenizer,
                      stop_ids=tiny.stop_ids)
    seqs = [sched.submit(r) for r in requests]
    sched.run()
    got = [[e for e in s.drain() if isinstance(e, (DoneEvent, ErrorEvent))][-1] for s in seqs]
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert sched.steps < sum(len(w.tokens) + 1 for w in want)          # really batched
    jsonschema.validate(json.loads(got[0].text), PERSON)
    jsonschema.validate(json.loads(got[1].text), LIST)
    assert got[0].finish_reason == got[1].finish_reason == "stop"
    with pytest.raises(json.JSONDecodeError):
        json.loads(got[2].text)          # the same model unconstrained: no JSON


def test_speculative_drafts_are_verified_against_the_grammar(tiny):
    # a prompt full of repeats, so that prompt lookup drafts often
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]
    plain = _alone(tiny, _request(prompt, PERSON, SamplingParams(temperature=0.9, seed=2)))
    settings = SpeculativeSettings(max_draft=4, adaptive=False, min_ngram=1)
    controller = SpeculationController(settings)
    events = list(stream_generate(tiny.model, tiny.tokenizer, _request(prompt, PERSON, SamplingParams(
        temperature=0.9, seed=2), speculative=settings), stop_ids=tiny.stop_ids, cache=KVCache(tiny.spec, CTX),
        speculation=controller))
    spec = events[-1]
    assert isinstance(spec, DoneEvent) and spec.tokens == plain.tokens
    assert controller.drafted > 0               # drafts were proposed, and only the grammar's choices kept
    jsonschema.validate(json.loads(spec.text), PERSON)


def test_the_mask_allows_exactly_what_the_grammar_allows(tiny):
    c = make_constraint(json_object_grammar(), tiny.tokenizer, tiny.spec.vocab_size, tiny.stop_ids)
    logits = np.zeros(tiny.spec.vocab_size, dtype=np.float32)
    out = c(logits, [])
    allowed = {tiny.tokenizer.decode([i]) for i in np.flatnonzero(out > -np.inf)}
    assert "{" in allowed and "}" not in allowed and "a" not in allowed
    assert all(not s.strip() or s == "{" for s in allowed)     # "{" or leading whitespace
    for s in "{}":
        c.advance(tiny.tokenizer.token_to_id(s))
    assert c.complete
    ends = np.flatnonzero(c(logits, []) > -np.inf)
    assert set(ends.tolist()) <= set(tiny.stop_ids) | {tiny.tokenizer.token_to_id(s) for s in " \n\t"}
    with pytest.raises(GenerationError, match="does not continue"):
        c.advance(tiny.tokenizer.token_to_id("x"))


def test_a_model_without_a_tokenizer_is_refused(tiny):
    with pytest.raises(GenerationError, match="tokenizer"):
        make_constraint(json_object_grammar(), None, tiny.spec.vocab_size, tiny.stop_ids)


@pytest.mark.parametrize("schema, words", [
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum (5) is greater than maximum (1)"),
    ({"pattern": "(("}, "unclosed group"),
    ({"$ref": "#/nope"}, "/nope"),
    ({"type": "number", "minimum": float("nan")}, "cannot be read"),
])
def test_a_schema_it_cannot_use_is_refused_with_the_reason(schema, words):
    with pytest.raises(GenerationError, match="schema") as caught:
        json_schema_grammar(schema)
    assert words in str(caught.value)


@pytest.mark.slow
def test_smollm2_answers_json_object_that_parses(smol_model):
    # the real model: json_object, greedy, within a tight budget the constraint steers it to close
    tok = smol_model.tokenizer
    for prompt in ("Describe a cat as a JSON object.", "Give the facts about Paris as JSON."):
        ids = tok.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
        request = GenerationRequest(prompt=tuple(ids), max_tokens=40, grammar=json_object_grammar())
        done = list(stream_generate(smol_model.model, tok, request, stop_ids=smol_model.stop_ids,
                                    cache=KVCache(smol_model.spec, CTX)))[-1]
        assert isinstance(json.loads(done.text), dict), done.text


@pytest.fixture(scope="module")
def smol_model(smollm2_gguf):
    return load_model(smollm2_gguf)
