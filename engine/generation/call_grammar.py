"""Grammars of tool calls, one per call format (engine.tokenizer.tool_calls): what a call of the offered tools may
look like, with its arguments matching the tool's JSON schema, so that the call always parses.

Two uses:
- forced (`tool_choice` "required" or a named tool): the whole answer is one call;
- lazy (`tool_choice` "auto"): the answer is free text until the format's opener is written (`Grammar.triggers`),
  then the call is constrained, then the text is free again (formats whose calls close with a marker) or the answer
  ends (formats whose call is the end of the answer: Llama 3's JSON, harmony's message to a function).

Markers that are special tokens of the model's vocabulary are written `<[id]>` in the grammar (llguidance matches a
special token only by its id); the others as text. Argument values of GLM's XML-like calls follow the property's
schema where it is JSON, and are free text up to the closing marker where the property is a string.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.errors import GenerationError
from engine.generation.grammar import Grammar, Trigger, lark_grammar
from engine.tokenizer.reasoning import CHANNEL, CONSTRAIN, END, MESSAGE, START, TO_FUNCTION
from engine.tokenizer.tool_calls import (
    ARG_KEY,
    ARG_KEY_END,
    ARG_VALUE,
    ARG_VALUE_END,
    PYTHON_TAG,
    TOOL_CLOSE,
    TOOL_OPEN,
    ToolFormat,
)

# compact JSON, as templates write past calls: no run of whitespace for a weak model to wander into
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

SpecialId = Callable[[str], "int | None"]


def call_grammar(fmt: ToolFormat, schemas: Mapping[str, Any], names: Sequence[str], special: SpecialId,
                 forced: bool) -> Grammar:
    """The grammar of a call of one of `names` (tool name -> parameters schema in `schemas`) in format `fmt`: the
    whole answer when `forced`, else lazy (free text until the call opens). `special(marker)` is the id of a marker
    that is one special token of the vocabulary (None: the marker is text). GenerationError naming a schema that
    cannot constrain a call."""
    if not names:
        raise GenerationError("a call grammar needs at least one tool")
    lit = _literals(special)
    what = f"a call of {' or '.join(names)}"
    if fmt == "hermes":
        call = _json_call(schemas, names, "arguments")
        if forced:
            lark = f"start: {lit(TOOL_OPEN)} \"\\n\" call \"\\n\" {lit(TOOL_CLOSE)}\n{call}"
            return lark_grammar(lark, what)
        lark = f"start: \"\\n\"? call \"\\n\"? {lit(TOOL_CLOSE)}\n{call}"
        return _lazy(lark, what, (Trigger(TOOL_OPEN),), reopen=True)
    if fmt == "llama3":
        call = _json_call(schemas, names, "parameters")
        if forced:
            return lark_grammar(f"start: call\n{call}", what)
        # a call is the whole answer: its JSON first, or after <|python_tag|>
        return _lazy(f"start: \" \"? call\n{call}", what,
                     (Trigger("{", at_start=True, kept=True), Trigger(PYTHON_TAG)), reopen=False)
    if fmt == "glm":
        body = _glm_body(schemas, names, lit)
        if forced:
            return lark_grammar(f"start: {lit(TOOL_OPEN)} body\n{body}", what)
        return _lazy(f"start: body\n{body}", what, (Trigger(TOOL_OPEN),), reopen=True)
    if fmt == "harmony":
        calls = _harmony_calls(schemas, names, lit)
        if forced:
            # the prompt ends in `<|start|>assistant`: the model may reason first (an analysis message), then calls
            analysis = (f"analysis: {lit(CHANNEL)} \"analysis\" {lit(MESSAGE)} TEXT {lit(END)} {lit(START)} "
                        "\"assistant\"\nTEXT: /(.|\\n)*/\n")
            lark = (f"start: analysis? {lit(CHANNEL)} \"commentary {TO_FUNCTION}\" calls\n{analysis}{calls}")
            return lark_grammar(lark, what)
        return _lazy(f"start: calls\n{calls}", what, (Trigger(TO_FUNCTION),), reopen=False)
    raise GenerationError(f"no call grammar for the {fmt!r} tool-call format")


def _lazy(lark: str, what: str, triggers: tuple[Trigger, ...], reopen: bool) -> Grammar:
    g = lark_grammar(lark, what)
    return Grammar(g.source, g.what, triggers=triggers, reopen=reopen)


def _literals(special: SpecialId) -> Callable[[str], str]:
    def lit(marker: str) -> str:
        token = special(marker)
        return f"<[{token}]>" if token is not None else json.dumps(marker)
    return lit


def _schema_json(schema: Any) -> str:
    try:
        return json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise GenerationError(f"a tool's parameters schema is not plain JSON: {exc}") from None


def _json_call(schemas: Mapping[str, Any], names: Sequence[str], key: str) -> str:
    """The rule `call`: the JSON object {"name": N, key: arguments} of one of `names`."""
    one = [{"type": "object", "properties": {"name": {"const": n}, key: schemas[n]}, "required": ["name", key],
            "additionalProperties": False} for n in names]
    return f"call: %json {_schema_json({'anyOf': one, 'x-guidance': _COMPACT})}\n"


def _harmony_calls(schemas: Mapping[str, Any], names: Sequence[str], lit: Callable[[str], str]) -> str:
    """The rule `calls`: after `to=functions.`, a tool's name, the rest of the header, `<|message|>`, its arguments
    (the end-of-call token is a stop id: the answer ends there)."""
    rules = [f"calls: {' | '.join(f'call{i}' for i in range(len(names)))}",
             # ` <|constrain|>json`, `<|channel|>commentary json`: a name's end is a space or a marker
             f"header: (HWORDS | {lit(CHANNEL)} WORDS | {lit(CONSTRAIN)} WORDS)*", "HWORDS: / [ a-z]*/",
             "WORDS: /[ a-z]+/"]
    for i, n in enumerate(names):
        args = {**_object_schema(schemas[n]), "x-guidance": _COMPACT}
        rules.append(f"call{i}: {json.dumps(n)} header {lit(MESSAGE)} %json {_schema_json(args)}")
    return "\n".join(rules) + "\n"


def _glm_body(schemas: Mapping[str, Any], names: Sequence[str], lit: Callable[[str], str]) -> str:
    """The rule `body`: after `<tool_call>`, a tool's name, its arguments as `<arg_key>K</arg_key><arg_value>V
    </arg_value>` in the schema's order (required ones present), then `</tool_call>`."""
    rules = [f"body: ({' | '.join(f'call{i}' for i in range(len(names)))}) \"\\n\"? {lit(TOOL_CLOSE)}"]
    if lit(ARG_VALUE_END).startswith("<["):     # a special token: no text can run into it
        rules.append(f"str_value: TEXT {lit(ARG_VALUE_END)}\nTEXT: /(.|\\n)*/")
    else:                                        # text: the value ends at the first closing marker
        rules.append(f"str_value[lazy]: /(.|\\n)*/ {lit(ARG_VALUE_END)}")
    for i, n in enumerate(names):
        schema = _object_schema(schemas[n])
        props = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        required = set(schema.get("required") or ()) if isinstance(schema.get("required"), list) else set()
        parts = []
        for j, (key, prop) in enumerate(props.items()):
            rule = f"arg{i}_{j}"
            rules.append(f"{rule}: \"\\n\"? {lit(ARG_KEY)} {json.dumps(key)} {lit(ARG_KEY_END)} \"\\n\"? "
                         f"{lit(ARG_VALUE)} {_glm_value(prop, lit)}")
            parts.append(rule if key in required else f"{rule}?")
        if not props:       # any object: keys and JSON values as the model likes
            rules.append(f"any{i}: \"\\n\"? {lit(ARG_KEY)} /[A-Za-z0-9_.-]+/ {lit(ARG_KEY_END)} \"\\n\"? "
                         f"{lit(ARG_VALUE)} %json {{}} {lit(ARG_VALUE_END)}")
            parts.append(f"any{i}*")
        rules.append(f"call{i}: {json.dumps(n)} {' '.join(parts)}")
    return "\n".join(rules) + "\n"


def _glm_value(prop: Any, lit: Callable[[str], str]) -> str:
    """A GLM argument value and its closing marker: a string bare (its enum's or const's values where it has
    them), anything else as JSON."""
    kind = prop.get("type") if isinstance(prop, Mapping) else None
    if kind == "string":
        choices = prop.get("enum") if isinstance(prop.get("enum"), list) else \
            [prop["const"]] if "const" in prop else None
        if choices and all(isinstance(c, str) for c in choices):
            return f"({' | '.join(json.dumps(c) for c in choices)}) {lit(ARG_VALUE_END)}"
        bounds = [prop.get(k) for k in ("minLength", "maxLength")]
        if isinstance(prop.get("pattern"), str):       # anchored, as llguidance reads a JSON schema's pattern
            return f"/{_regex(prop['pattern'])}/ {lit(ARG_VALUE_END)}"
        if any(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
            low, high = (b if isinstance(b, int) and not isinstance(b, bool) else None for b in bounds)
            return f"/(.|\\n){{{low or 0},{'' if high is None else high}}}/ {lit(ARG_VALUE_END)}"
        return "str_value"
    return f"%json {_schema_json(prop if isinstance(prop, Mapping) else {})} {lit(ARG_VALUE_END)}"


def _regex(pattern: str) -> str:
    """A JSON schema's pattern as a Lark regex literal's body."""
    return pattern.replace("/", "\\/")


def _object_schema(schema: Any) -> dict:
    """A tool's parameters schema as an object schema (a tool without one takes any object)."""
    if not isinstance(schema, Mapping) or not schema:
        return {"type": "object"}
    return dict(schema)
