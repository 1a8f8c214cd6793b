"""Grammars of tool calls, one per call format (engine.tokenizer.tool_calls): what a call of the offered tools may
look like, with its arguments matching the tool's JSON schema, so that the call always parses.

Two uses:
- forced (`tool_choice` "required" or a named tool): the whole answer is one call;
- lazy (`tool_choice` "auto"): the answer is free text until the format's opener is written (`Grammar.triggers`),
  then the call is constrained, then the text is free again (formats whose calls close with a marker) or the answer
  ends (formats whose call is the end of the answer: Llama 3's JSON, harmony's message to a function).

Markers that are special tokens of the model's vocabulary are written `<[id]>` in the grammar (llguidance matches a
special token only by its id); the others as text. Argument values written bare (GLM's, MiniMax's) follow the
property's schema where it is JSON, and are text up to the closing marker where the property is a string (its
enum, pattern or length kept). Tools' schemas are compiled leniently: a keyword llguidance does not implement
(uniqueItems, say) is left unchecked rather than refusing the request.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from engine.errors import GenerationError
from engine.generation.grammar import Grammar, Trigger, lark_grammar
from engine.tokenizer.reasoning import CHANNEL, CONSTRAIN, END, MESSAGE, START, THINK_CLOSE, THINK_OPEN, TO_FUNCTION
from engine.tokenizer.tool_calls import (
    ARG_KEY,
    ARG_KEY_END,
    ARG_VALUE,
    ARG_VALUE_END,
    DS_CALL,
    DS_CALL_END,
    DS_CALLS,
    DS_CALLS_END,
    DS_SEP,
    KIMI_ARGS,
    KIMI_CALL,
    KIMI_CALL_END,
    KIMI_CALLS,
    KIMI_CALLS_END,
    MM_CALLS,
    MM_CALLS_END,
    PYTHON_TAG,
    TOOL_CLOSE,
    TOOL_OPEN,
    ToolFormat,
)

# compact JSON, as templates write past calls: no run of whitespace for a weak model to wander into; lenient: a
# keyword llguidance does not implement (uniqueItems, not ...) is left unchecked rather than failing the request
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}

SpecialId = Callable[[str], "int | None"]
Thinking = Literal["open", "may"] | None


def call_grammar(fmt: ToolFormat, schemas: Mapping[str, Any], names: Sequence[str], special: SpecialId,
                 forced: bool, thinking: Thinking = None) -> Grammar:
    """The grammar of a call of one of `names` (tool name -> parameters schema in `schemas`) in format `fmt`: the
    whole answer when `forced`, else lazy (free text until the call opens). `special(marker)` is the id of a marker
    that is one special token of the vocabulary (None: the marker is text). `thinking`, for a model that reasons
    in `<think>`: "open" when the prompt leaves it reasoning, so that a forced call starts once the reasoning is
    closed (and the answer may not end before it); "may" when it may open reasoning first, so that a forced answer
    may begin with `<think>...</think>`. GenerationError naming a schema that cannot constrain a call."""
    if not names:
        raise GenerationError("a call grammar needs at least one tool")
    lit = _literals(special)
    what = f"a call of {' or '.join(names)}"
    if fmt == "hermes":
        call = _json_call(schemas, names, "arguments")
        if forced:
            lark = f"start: {lit(TOOL_OPEN)} \"\\n\" call \"\\n\" {lit(TOOL_CLOSE)}\n{call}"
            return _forced(lark, what, thinking, lit)
        lark = f"start: \"\\n\"? call \"\\n\"? {lit(TOOL_CLOSE)}\n{call}"
        return _lazy(lark, what, (Trigger(TOOL_OPEN),), reopen=True)
    if fmt == "llama3":
        call = _json_call(schemas, names, "parameters")
        if forced:
            return _forced(f"start: call\n{call}", what, thinking, lit)
        # a call is the whole answer: its JSON first, or after <|python_tag|>
        return _lazy(f"start: \" \"? call\n{call}", what,
                     (Trigger("{", at_start=True, kept=True), Trigger(PYTHON_TAG)), reopen=False)
    if fmt == "glm":
        body = _glm_body(schemas, names, lit)
        if forced:
            return _forced(f"start: {lit(TOOL_OPEN)} body\n{body}", what, thinking, lit)
        return _lazy(f"start: body\n{body}", what, (Trigger(TOOL_OPEN),), reopen=True)
    if fmt == "harmony":
        calls = _harmony_calls(schemas, names, lit)
        if forced:
            # the prompt ends in `<|start|>assistant`: the model may reason first (an analysis message), then calls
            analysis = (f"analysis: {lit(CHANNEL)} \"analysis\" {lit(MESSAGE)} TEXT {lit(END)} {lit(START)} "
                        "\"assistant\"\nTEXT: /(.|\\n)*/\n")
            lark = (f"start: analysis? {lit(CHANNEL)} \"commentary {TO_FUNCTION}\" calls\n{analysis}{calls}")
            return _forced(lark, what, thinking, lit)
        return _lazy(f"start: calls\n{calls}", what, (Trigger(TO_FUNCTION),), reopen=False)
    if fmt in ("deepseek", "kimi", "minimax"):
        body = _minimax_body(schemas, names, lit, not forced) if fmt == "minimax" else \
            _sections(fmt, schemas, names, lit, not forced)
        opener = {"deepseek": DS_CALLS, "kimi": KIMI_CALLS, "minimax": MM_CALLS}[fmt]
        if forced:
            return _forced(f"start: {lit(opener)} body\n{body}", what, thinking, lit)
        return _lazy(f"start: body\n{body}", what, (Trigger(opener),), reopen=True)
    raise GenerationError(f"no call grammar for the {fmt!r} tool-call format")


def _forced(lark: str, what: str, thinking: Thinking, lit: Callable[[str], str]) -> Grammar:
    """A forced call's grammar: the whole answer (after an optional `<think>...</think>` when `thinking` is "may"),
    or ("open") all that follows `</think>`, with the answer required to get there; newlines may follow reasoning."""
    if thinking == "open":
        g = lark_grammar(lark.replace("start: ", 'start: "\\n"? "\\n"? ', 1), what)
        return Grammar(g.source, g.what, triggers=(Trigger(THINK_CLOSE),), required=True)
    if thinking == "may":
        if lit(THINK_CLOSE).startswith("<["):       # special markers: no text runs into the closing one
            think = f"think: {lit(THINK_OPEN)} THINK_TEXT {lit(THINK_CLOSE)}\nTHINK_TEXT: /(.|\\n)*/\n"
        else:                                       # text markers: the reasoning ends at the first closing one
            think = f"think[lazy]: {lit(THINK_OPEN)} /(.|\\n)*/ {lit(THINK_CLOSE)}\n"
        lark = lark.replace("start: ", 'start: (think "\\n"? "\\n"?)? ', 1) + think
    return lark_grammar(lark, what)


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
             # ` <|constrain|>json` or `<|channel|>commentary json`, as gpt-oss writes and its template renders
             f"header: (\" \" | {lit(CHANNEL)} \"commentary \") {lit(CONSTRAIN)}? \"json\""]
    for i, n in enumerate(names):
        args = {**_object_schema(schemas[n]), "x-guidance": _COMPACT}
        rules.append(f"call{i}: {json.dumps(n)} header {lit(MESSAGE)} %json {_schema_json(args)}")
    return "\n".join(rules) + "\n"


def _glm_body(schemas: Mapping[str, Any], names: Sequence[str], lit: Callable[[str], str]) -> str:
    """The rule `body`: after `<tool_call>`, a tool's name, its arguments as `<arg_key>K</arg_key><arg_value>V
    </arg_value>` in the schema's order (required ones present), then `</tool_call>`."""
    rules = [f"body: ({' | '.join(f'call{i}' for i in range(len(names)))}) \"\\n\"? {lit(TOOL_CLOSE)}"]
    rules += _bare_calls(schemas, names, json.dumps,
                         lambda k: f"\"\\n\"? {lit(ARG_KEY)} {k} {lit(ARG_KEY_END)} \"\\n\"? {lit(ARG_VALUE)}",
                         lit(ARG_VALUE_END))
    return "\n".join(rules) + "\n"


def _minimax_body(schemas: Mapping[str, Any], names: Sequence[str], lit: Callable[[str], str], many: bool) -> str:
    """The rule `body`: after `<minimax:tool_call>`, one or more `<invoke name="N"><parameter name="K">V
    </parameter>...</invoke>`, then `</minimax:tool_call>`."""
    calls = " | ".join(f"call{i}" for i in range(len(names)))
    rules = [f"body: (\"\\n\"? ({calls}) \"\\n\"? \"</invoke>\"){'+' if many else ''} \"\\n\"? {lit(MM_CALLS_END)}"]
    rules += _bare_calls(schemas, names, lambda n: json.dumps(f'<invoke name="{n}">'),
                         lambda k: f"\"\\n\"? \"<parameter name=\\\"\" {k} \"\\\">\"", json.dumps("</parameter>"))
    return "\n".join(rules) + "\n"


def _bare_calls(schemas: Mapping[str, Any], names: Sequence[str], head: Callable[[str], str],
                key: Callable[[str], str], end: str) -> list[str]:
    """Rules `call{i}` of calls whose arguments are written bare (GLM's, MiniMax's): `head(name)`, then each
    argument as `key(K)` (K a grammar expression of the name) and its value closed by `end`, in the schema's
    order with the required ones present."""
    if end.startswith("<["):        # a special token: no text can run into it
        rules = [f"str_value: TEXT {end}", "TEXT: /(.|\\n)*/"]
    else:                           # text: the value ends at the first closing marker
        rules = [f"str_value[lazy]: /(.|\\n)*/ {end}"]
    for i, n in enumerate(names):
        schema = _object_schema(schemas[n])
        found = schema.get("properties")
        props: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        required = set(schema.get("required") or ()) if isinstance(schema.get("required"), list) else set()
        parts = []
        for j, (k, prop) in enumerate(props.items()):
            value = _bare_value(prop, end)
            if value.startswith("/") and not end.startswith("<["):
                # a text closer could be spelled inside the value: the value ends at its first closer
                rules.append(f"value{i}_{j}[lazy]: {value}")
                value = f"value{i}_{j}"
            rules.append(f"arg{i}_{j}: {key(json.dumps(k))} {value}")
            parts.append(f"arg{i}_{j}" if k in required else f"arg{i}_{j}?")
        if not props:       # any object: keys and JSON values as the model likes
            rules.append(f"any{i}: {key('/[A-Za-z0-9_.-]{1,64}/')} %json {{}} {end}")
            parts.append(f"any{i}*")
        rules.append(f"call{i}: {head(n)} {' '.join(parts)}")
    return rules


def _bare_value(prop: Any, end: str) -> str:
    """An argument value written bare and its closing `end`: a string as it is (its enum's or const's values, its
    pattern or length where it has them), anything else as JSON."""
    kind = prop.get("type") if isinstance(prop, Mapping) else None
    if kind == "string":
        choices = prop.get("enum") if isinstance(prop.get("enum"), list) else \
            [prop["const"]] if "const" in prop else None
        if choices and all(isinstance(c, str) for c in choices):
            return f"({' | '.join(json.dumps(c) for c in choices)}) {end}"
        bounds = [prop.get(k) for k in ("minLength", "maxLength")]
        if isinstance(prop.get("pattern"), str):       # anchored, as llguidance reads a JSON schema's pattern
            return f"/{_regex(prop['pattern'])}/ {end}"
        if any(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
            low, high = (b if isinstance(b, int) and not isinstance(b, bool) else None for b in bounds)
            return f"/(.|\\n){{{low or 0},{'' if high is None else high}}}/ {end}"
        return "str_value"
    value = {**(prop if isinstance(prop, Mapping) else {}), "x-guidance": {"lenient": True}}
    return f"%json {_schema_json(value)} {end}"


def _sections(fmt: str, schemas: Mapping[str, Any], names: Sequence[str], lit: Callable[[str], str],
              many: bool) -> str:
    """The rule `body` of DeepSeek's and Kimi's call sections: after the section's opener, one call (`many`: one
    or more), then the section's closer."""
    rules = []
    for i, n in enumerate(names):
        args = f"%json {_schema_json({**_object_schema(schemas[n]), 'x-guidance': _COMPACT})}"
        if fmt == "deepseek":   # V3.1 writes the name then the arguments; V3 and R1 the type, name, fenced JSON
            rules.append(f"call{i}: {lit(DS_CALL)} ({json.dumps(n)} {lit(DS_SEP)} {args} | \"function\" "
                         f"{lit(DS_SEP)} {json.dumps(n + chr(10) + '```json' + chr(10))} {args} "
                         f"\"\\n```\") {lit(DS_CALL_END)}")
        else:
            # the call's id, functions.NAME:INDEX (an index of a few digits: no endless run to wander into)
            rules.append(f"call{i}: {lit(KIMI_CALL)} {json.dumps('functions.' + n + ':')} /[0-9]{{1,3}}/ "
                         f"{lit(KIMI_ARGS)} {args} {lit(KIMI_CALL_END)}")
    end = lit(DS_CALLS_END if fmt == "deepseek" else KIMI_CALLS_END)
    rules.append(f"body: (\"\\n\"? ({' | '.join(f'call{i}' for i in range(len(names)))})){'+' if many else ''} "
                 f"\"\\n\"? {end}")
    return "\n".join(rules) + "\n"


def _regex(pattern: str) -> str:
    """A JSON schema's pattern as a Lark regex literal's body."""
    return pattern.replace("/", "\\/")


def _object_schema(schema: Any) -> dict:
    """A tool's parameters schema as an object schema (a tool without one takes any object)."""
    if not isinstance(schema, Mapping) or not schema:
        return {"type": "object"}
    return dict(schema)
