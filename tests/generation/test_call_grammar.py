"""Tool-call grammars (engine.generation.call_grammar) in every format Colibri reads, driven by a scripted logits
source: random logits (a random model's preferences) with the script's next token lifted far above them while the
output follows the script. Each script begins a call the way its family does, then writes arguments that break the
tool's schema: unconstrained, that call does not validate; constrained, the grammar makes the output stray from the
script into a call whose arguments validate with `jsonschema`.

Lazy grammars (tool_choice "auto") leave the text free, unmasked, until the opener, and (formats whose calls close
with a marker) after the call again. Forced grammars (a required call) make the whole answer one call."""

from __future__ import annotations

from dataclasses import replace

import jsonschema
import numpy as np
import pytest

from engine.generation.call_grammar import call_grammar
from engine.generation.grammar import LazyConstraint, make_constraint
from engine.tokenizer.core import Tokenizer
from engine.tokenizer.reasoning import open_parser
from engine.tokenizer.tool_calls import parse_tool_calls
from support.marker_chat import marker_tokenizer

SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city", "days"], "additionalProperties": False},
    "note": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "boolean"}}},
             "required": ["tags"], "additionalProperties": False},
}
HARMONY_PROMPT = "<|start|>user<|message|>Weather?<|end|><|start|>assistant"
# (format, prose before the call, the call's start as the family writes it with arguments off the schema)
LAZY = [
    ("hermes", "Let me look.\n", '<tool_call>\n{"name": "get_weather", "arguments": {"city": 7'),
    ("glm", "Checking.", "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>\"two\""),
    ("llama3", "", '{"name": "get_weather", "parameters": {"city": ["Paris"]'),
    ("harmony", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant",
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": 7'),
    ("deepseek", "Looking.", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": 7'),
    ("kimi", "Sure.", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                      '<|tool_call_argument_begin|>{"city": 7'),
    ("minimax", "Checking.\n", '<minimax:tool_call>\n<invoke name="get_weather"><parameter name="days">two'),
]
STEPS = 400


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    out = {}
    for fmt in ("hermes", "glm", "llama3", "harmony", "deepseek", "kimi", "minimax"):
        folder = tmp_path_factory.mktemp(fmt)
        ends = marker_tokenizer(folder, fmt)
        out[fmt] = (Tokenizer.from_folder(folder), frozenset(ends))
    return out


def _special(tokenizer):
    return lambda m: i if (i := tokenizer.token_to_id(m)) in tokenizer.special_ids else None


def _run(tokenizer, ends, constraint, script: str, seed: int = 0):
    """The ids chosen, and for each step whether the constraint left the logits as they were."""
    want = tokenizer.encode(script, add_special_tokens=False)
    rng = np.random.default_rng(seed)
    out, untouched = [], []
    for _ in range(STEPS):
        logits = rng.normal(size=tokenizer.vocab_size).astype(np.float32)
        if len(out) < len(want) and out == want[:len(out)]:
            logits[want[len(out)]] = 100.0
        row = logits if constraint is None else constraint(logits, None)
        untouched.append(np.array_equal(row, logits))
        token = int(np.argmax(row))
        if constraint is not None:
            constraint.advance(token)
        out.append(token)
        if token in ends:
            break
    return out, untouched


def _calls(fmt, tokenizer, ends, ids):
    """The answer's text (the reasoning split off) and its prose and calls."""
    text = tokenizer.decode(ids[:-1] if ids and ids[-1] in ends else ids)
    reasoning = tokenizer.reasoning_format if fmt == "harmony" else None
    if reasoning is not None:
        split = open_parser(reasoning.after(HARMONY_PROMPT))
        text = split.feed(text).content + split.flush().content
    return text, parse_tool_calls(fmt, text, SCHEMAS)


@pytest.mark.parametrize("fmt, prose, call", LAZY)
def test_a_call_opened_freely_gets_arguments_that_validate(tokenizers, fmt, prose, call):
    tokenizer, ends = tokenizers[fmt]
    free, _ = _run(tokenizer, ends, None, prose + call)
    _, (_, loose) = _calls(fmt, tokenizer, ends, free)
    assert all(not _valid(c) for c in loose)        # the script's own call breaks the schema

    grammar = call_grammar(fmt, SCHEMAS, list(SCHEMAS), _special(tokenizer), forced=False)
    constraint = make_constraint(grammar, tokenizer, tokenizer.vocab_size, ends, budget=STEPS)
    assert isinstance(constraint, LazyConstraint)
    ids, untouched = _run(tokenizer, ends, constraint, prose + call)
    opened = len(tokenizer.encode(prose + call[:_opener_end(fmt, call)], add_special_tokens=False))
    assert all(untouched[:opened]) and not all(untouched[opened:])   # free until the opener, then masked
    assert ids[:opened] == free[:opened] and constraint.calls >= 1
    text, (_, calls) = _calls(fmt, tokenizer, ends, ids)
    assert calls, text
    for c in calls:
        jsonschema.validate(c.arguments, SCHEMAS[c.name])


def _opener_end(fmt: str, call: str) -> int:
    """Where the trigger of `fmt` ends in `call` (the text up to there is free)."""
    trigger = {"hermes": "<tool_call>", "glm": "<tool_call>", "llama3": "", "harmony": "to=functions.",
               "deepseek": "<｜tool▁calls▁begin｜>", "kimi": "<|tool_calls_section_begin|>",
               "minimax": "<minimax:tool_call>"}[fmt]
    return call.index(trigger) + len(trigger) if trigger else 0


def _valid(call) -> bool:
    try:
        jsonschema.validate(call.arguments, SCHEMAS[call.name])
    except jsonschema.ValidationError:
        return False
    return True


def test_text_after_a_closed_call_is_free_again(tokenizers):
    tokenizer, ends = tokenizers["hermes"]
    grammar = call_grammar("hermes", SCHEMAS, list(SCHEMAS), _special(tokenizer), forced=False)
    constraint = make_constraint(grammar, tokenizer, tokenizer.vocab_size, ends, budget=STEPS)
    script = '<tool_call>\n{"name": "note", "arguments": {"tags": [true]}}\n</tool_call>\nDone, and 3 < 4.'
    ids, untouched = _run(tokenizer, ends, constraint, script)
    assert tokenizer.decode(ids).startswith(script)          # a valid call passes as written
    closed = len(tokenizer.encode(script.split("\nDone")[0], add_special_tokens=False))
    assert all(untouched[closed:]) and constraint.active is None and constraint.calls == 1


def test_llama3_prose_is_never_constrained(tokenizers):
    tokenizer, ends = tokenizers["llama3"]
    grammar = call_grammar("llama3", SCHEMAS, list(SCHEMAS), _special(tokenizer), forced=False)
    constraint = make_constraint(grammar, tokenizer, tokenizer.vocab_size, ends, budget=STEPS)
    script = 'Paris is in France {"name": "x"}.'
    ids, untouched = _run(tokenizer, ends, constraint, script)
    assert tokenizer.decode(ids).startswith(script) and all(untouched) and constraint.calls == 0


@pytest.mark.parametrize("fmt, prose, call", LAZY)
@pytest.mark.parametrize("only", [None, "note"])
def test_a_forced_call_is_one_call_that_validates(tokenizers, fmt, prose, call, only):
    """Forced, the model's prose and its off-schema call both give way: one call of an allowed tool."""
    tokenizer, ends = tokenizers[fmt]
    names = [only] if only else list(SCHEMAS)
    grammar = call_grammar(fmt, SCHEMAS, names, _special(tokenizer), forced=True)
    constraint = make_constraint(grammar, tokenizer, tokenizer.vocab_size, ends, budget=STEPS)
    ids, _ = _run(tokenizer, ends, constraint, "I would rather not." + call, seed=1)
    assert ids[-1] in ends and constraint.complete
    text, (rest, calls) = _calls(fmt, tokenizer, ends, ids)
    assert len(calls) == 1 and not rest.strip(), text
    assert calls[0].name in names
    jsonschema.validate(calls[0].arguments, SCHEMAS[calls[0].name])


@pytest.mark.parametrize("fmt", ["hermes", "glm", "minimax"])
@pytest.mark.parametrize("thinking", ["may", "open"])
def test_a_forced_call_follows_the_models_reasoning(tokenizers, fmt, thinking):
    """A model that reasons in <think> reasons first, as it wrote it; then (its arguments off the schema) it makes
    one call that validates. "open": the prompt opened the reasoning; "may": the model opens it."""
    tokenizer, ends = tokenizers[fmt]
    special = _special(tokenizer)
    grammar = call_grammar(fmt, SCHEMAS, list(SCHEMAS), special, forced=True, thinking=thinking)
    constraint = make_constraint(grammar, tokenizer, tokenizer.vocab_size, ends, budget=STEPS)
    thought = ("" if thinking == "open" else "<think>") + "I should call it.</think>\n\n"
    call = dict((f, c) for f, _, c in LAZY)[fmt]
    ids, _ = _run(tokenizer, ends, constraint, thought + call, seed=2)
    assert ids[:len(tokenizer.encode(thought, add_special_tokens=False))] == \
        tokenizer.encode(thought, add_special_tokens=False)            # the reasoning passes as written
    split = open_parser(replace(tokenizer.reasoning_format, start="reasoning" if thinking == "open" else "content"))
    text = tokenizer.decode(ids[:-1] if ids[-1] in ends else ids)
    parts = split.feed(text) + split.flush()
    assert parts.reasoning == "I should call it." and ids[-1] in ends
    rest, calls = parse_tool_calls(fmt, parts.content, SCHEMAS)
    assert len(calls) == 1 and not rest.strip(), parts.content
    jsonschema.validate(calls[0].arguments, SCHEMAS[calls[0].name])


def test_a_keyword_llguidance_lacks_leaves_that_keyword_unchecked():
    """Tool schemas come from clients as they are: a keyword the grammar library does not implement (uniqueItems)
    must not fail the request; the rest of the schema still constrains the call."""
    odd = {"f": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "integer"},
                                                           "uniqueItems": True}}, "required": ["tags"]}}
    for fmt in ("hermes", "glm", "llama3", "harmony", "deepseek", "kimi", "minimax"):
        for forced in (True, False):
            assert call_grammar(fmt, odd, ["f"], lambda m: None, forced).source
