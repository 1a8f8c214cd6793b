"""Tool calls as every API route needs them: the tools a request offers, checked and put in the JSON-schema
function form chat templates read (OpenAI's and Ollama's `tools` already are; Anthropic's are converted), the
choice of whether the model may call (`tool_choice`), and the answer's text split into prose and calls as it
streams (`AnswerSplitter`, over engine.tokenizer.tool_calls), so that a route only shapes what comes out.

`tool_choice` "auto", "none" and forced calls are honoured, in every format (engine.generation.call_grammar,
through llguidance): a forced choice ("required", Anthropic's "any", one named tool) constrains the whole answer to
one call of the allowed tools, its arguments matching the tool's schema; under "auto" the answer is free until the
model opens a call, whose arguments are then constrained the same way (`answer_grammar`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from app.server.errors import ApiError
from engine.errors import ColibriError
from engine.generation.call_grammar import Thinking, call_grammar
from engine.generation.grammar import Grammar
from engine.tokenizer.reasoning import (
    CHANNEL,
    CONSTRAIN,
    END,
    MESSAGE,
    START,
    THINK_CLOSE,
    THINK_OPEN,
    ReasoningFormat,
)
from engine.tokenizer.tool_calls import (
    MARKERS,
    PYTHON_TAG,
    Piece,
    ToolCall,
    ToolCallParser,
    ToolFormat,
)

# the markers a call grammar writes, which some vocabularies hold as special tokens
_GRAMMAR_MARKERS = (*{m for ms in MARKERS.values() for m in ms}, PYTHON_TAG, START, CHANNEL, MESSAGE, CONSTRAIN, END,
                    THINK_OPEN, THINK_CLOSE)


@dataclass(frozen=True)
class Tools:
    """The tools a request offers the model, and how the model writes its calls."""

    fmt: ToolFormat
    functions: tuple[dict, ...]          # {"type": "function", "function": {name, description, parameters}}
    schemas: dict[str, dict]             # tool name -> JSON schema of its parameters
    forced: tuple[str, ...] = ()         # the tools one of which the answer must call (none: the model chooses)
    specials: tuple[tuple[str, int], ...] = ()   # the format's markers that are special tokens, and their ids

    def grammar(self, reasoning: ReasoningFormat | None = None) -> Grammar:
        """The grammar the answer is decoded under: one call of the forced tools (after the model's reasoning, for
        a model that reasons in `<think>`), or (the model choosing) free text in which a call, once opened, has
        arguments matching its tool's schema; 400 naming a schema that cannot be compiled."""
        names = self.forced or tuple(self.schemas)
        ids = dict(self.specials)
        thinking: Thinking = None
        if reasoning is not None and reasoning.kind == "think":
            thinking = "open" if reasoning.start == "reasoning" else "may"
        try:
            return call_grammar(self.fmt, self.schemas, names, ids.get, forced=bool(self.forced), thinking=thinking)
        except (ColibriError, ValueError) as exc:
            raise ApiError(400, f"tools: a tool's parameters schema cannot constrain its call: {exc}", "tools") \
                from None

    def template_tools(self) -> list[dict]:
        """The tools as the chat template's `tools` variable."""
        return [dict(f) for f in self.functions]

    def parser(self) -> ToolCallParser:
        """A fresh parser of this model's calls."""
        return ToolCallParser(self.fmt, self.schemas)


def _function(entry: Any, param: str, i: int) -> dict:
    """One OpenAI-shaped tool, checked: {"type": "function", "function": {"name", "description"?, "parameters"?}}."""
    where = f"{param}[{i}]"
    if not isinstance(entry, Mapping) or entry.get("type", "function") != "function":
        raise ApiError(400, f"{where}: only function tools are supported ({{\"type\": \"function\", "
                            "\"function\": {\"name\": ..., \"parameters\": {...}}}})", param)
    fn = entry.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ApiError(400, f"{where}.function.name: give the function's name", param)
    out = dict(fn)       # as sent, in its order: the template writes it out with tojson
    params = out.setdefault("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping):
        raise ApiError(400, f"{where}.function.parameters must be a JSON schema object", param)
    if out.get("description") is not None and not isinstance(out["description"], str):
        raise ApiError(400, f"{where}.function.description must be a string", param)
    return {"type": "function", "function": out}


def _offer(functions: list[dict], tokenizer: Any, param: str, forced: tuple[str, ...] = ()) -> Tools | None:
    if not functions:
        return None
    names = [f["function"]["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ApiError(400, f"{param}: two tools are named alike ({', '.join(sorted(names))}); name each apart", param)
    fmt = tokenizer.tool_format if tokenizer is not None else None
    if fmt is None:
        raise ApiError(400, "the served model's chat template writes no tool-call format Colibri reads (hermes "
                            "<tool_call>, GLM, Llama 3 JSON, harmony), so its calls could not be read back (Colibri "
                            f"does not implement it for this model); leave out {param}", param)
    unknown = [n for n in forced if n not in names]
    if unknown:
        raise ApiError(400, f"tool_choice names {unknown[0]!r}, which is not among the tools ({', '.join(names)})",
                       "tool_choice")
    specials = tuple((m, i) for m in _GRAMMAR_MARKERS
                     if (i := tokenizer.token_to_id(m)) is not None and i in tokenizer.special_ids)
    return Tools(fmt, tuple(functions), {f["function"]["name"]: f["function"]["parameters"] for f in functions},
                 forced, specials)


def openai_tools(tools: Any, tool_choice: Any, tokenizer: Any, param: str = "tools") -> Tools | None:
    """The tools of an OpenAI (or Ollama) request, or None when the model may not call any (none given, or
    tool_choice "none"); 400 for a malformed tool or a choice that forces a call."""
    named = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if tool_choice not in (None, "auto", "none", "required") and not (
            isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function"
            and isinstance(named, Mapping) and isinstance(named.get("name"), str)):
        raise ApiError(400, 'tool_choice: give "auto", "none", "required" or {"type": "function", "function": '
                            '{"name": ...}}', "tool_choice")
    if tools is None or tools == []:
        if tool_choice not in (None, "auto", "none"):
            raise ApiError(400, "tool_choice asks for a call, but no tools are given", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, f"{param} must be a list of function tools", param)
    functions = [_function(t, param, i) for i, t in enumerate(tools)]
    if tool_choice == "none":
        return None
    forced = tuple(f["function"]["name"] for f in functions) if tool_choice == "required" else \
        (named["name"],) if isinstance(named, Mapping) else ()
    return _offer(functions, tokenizer, param, forced)


def anthropic_tools(tools: Any, tool_choice: Any, tokenizer: Any) -> Tools | None:
    """The tools of an Anthropic request ({name, description, input_schema}) in the function form, or None."""
    kind = tool_choice.get("type") if isinstance(tool_choice, Mapping) else tool_choice
    if kind not in (None, "auto", "none", "any", "tool") or (
            kind == "tool" and not isinstance(tool_choice.get("name"), str)):
        raise ApiError(400, 'tool_choice: give {"type": "auto"}, {"type": "none"}, {"type": "any"} or '
                            '{"type": "tool", "name": ...}', "tool_choice")
    if tools is None or tools == []:
        if kind in ("any", "tool"):
            raise ApiError(400, "tool_choice asks for a call, but no tools are given", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "tools must be a list of {name, description, input_schema}", "tools")
    functions = []
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping) or t.get("type") not in (None, "custom"):
            kind_of = t.get("type") if isinstance(t, Mapping) else type(t).__name__
            raise ApiError(400, f"tools[{i}]: only client tools ({{name, description, input_schema}}) are supported, "
                                f"not {kind_of!r}", "tools")
        schema = t.get("input_schema")
        if not isinstance(schema, Mapping):
            raise ApiError(400, f"tools[{i}].input_schema: give the tool's input as a JSON schema object", "tools")
        fn = {"name": t.get("name"), **({"description": t["description"]} if "description" in t else {}),
              "parameters": schema}
        functions.append(_function({"type": "function", "function": fn}, "tools", i))
    if kind == "none":
        return None
    forced = tuple(f["function"]["name"] for f in functions) if kind == "any" else \
        (tool_choice["name"],) if kind == "tool" else ()
    return _offer(functions, tokenizer, "tools", forced)


def answer_grammar(shape: Grammar | None, tools: Tools | None, shape_param: str,
                   reasoning: ReasoningFormat | None = None) -> Grammar | None:
    """The grammar an answer is decoded under: a forced call's, else the structured output asked for (`shape`,
    from the request's `shape_param`), else the tools' lazy call grammar; 400 when both a forced call and a shape
    are asked for. `reasoning`: where the answer starts (answer_reasoning). Compiles: call it off the event loop."""
    if tools is not None and tools.forced:
        if shape is not None:
            raise ApiError(400, f"{shape_param} and a forced tool call (tool_choice) cannot both shape the answer; "
                                "drop one", "tool_choice")
        return tools.grammar(reasoning)
    if shape is not None or tools is None:
        return shape        # JSON asked for: a call would not be JSON of that shape anyway
    return tools.grammar()


def arguments(value: Any, param: str) -> dict:
    """A past call's arguments as the object templates iterate: OpenAI sends them as a JSON string."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str):
        try:
            parsed = json.loads(value) if value.strip() else {}
        except ValueError:
            raise ApiError(400, f"{param}: the arguments are not JSON ({value[:60]!r}); send the JSON object the "
                                "call was made with", param) from None
        if isinstance(parsed, dict):
            return parsed
    raise ApiError(400, f"{param}: the arguments must be a JSON object", param)


def keep_markers(reasoning: ReasoningFormat | None, tokenizer: Any, tools: Tools | None) -> ReasoningFormat | None:
    """The reasoning format with the tool format's markers kept in the decoded text (a model whose markers are
    special tokens, as GLM's are, would otherwise write its calls invisibly)."""
    if tools is None or tokenizer is None:
        return reasoning
    ids = frozenset(i for i in (tokenizer.token_to_id(m) for m in MARKERS[tools.fmt]) if i is not None)
    if reasoning is None:       # a model that does not reason: its answer is plain text, with the markers shown
        return ReasoningFormat("plain", ids) if ids else None
    return replace(reasoning, marker_ids=reasoning.marker_ids | ids)


def render_chat(tokenizer: Any, messages: list[dict], tools: Tools | None, prefill: str = "") -> tuple[list[int], str]:
    """The prompt's token ids and text: the messages (and the tools, if any) through the model's chat template, then
    `prefill` (an answer the client began); 400 naming `messages` when the template refuses them."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             **({"tools": tools.template_tools()} if tools else {})) + prefill
        return tokenizer.encode(text, add_special_tokens=False), text
    except ColibriError as exc:
        raise ApiError(400, str(exc), "messages") from None


def answer_reasoning(tokenizer: Any, text: str, tools: Tools | None) -> ReasoningFormat | None:
    """How the answer to the prompt `text` separates reasoning (None: the model does not reason apart), with the
    tool format's markers kept."""
    fmt = tokenizer.reasoning_format if tokenizer is not None else None
    return keep_markers(fmt.after(text) if fmt else None, tokenizer, tools)


def call_id(prefix: str = "call_") -> str:
    """A new id for a call the model made."""
    return prefix + uuid.uuid4().hex[:24]


class AnswerSplitter:
    """The answer's text as prose and calls, fed as it streams (`feed`, then `flush` once); without tools all of
    it is prose. Whitespace between or around calls is dropped once a call is made (templates put newlines
    there), so whole and streamed answers agree."""

    def __init__(self, tools: Tools | None):
        self._parser = tools.parser() if tools is not None else None
        self._space = ""          # whitespace-only prose held until more prose or the end
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Piece]:
        """Pieces completed by `text`."""
        if self._parser is None:
            return [text] if text else []
        return self._pass(self._parser.feed(text))

    def flush(self) -> list[Piece]:
        """Pieces still held at the end of the answer."""
        if self._parser is None:
            return []
        out = self._pass(self._parser.flush())
        if self._space and not self.calls:
            out.append(self._space)
        self._space = ""
        return out

    def _pass(self, pieces: Sequence[Piece]) -> list[Piece]:
        out: list[Piece] = []
        for p in pieces:
            if isinstance(p, ToolCall):
                self._space = ""
                self.calls.append(p)
                out.append(p)
            elif not p.strip():
                self._space += p
            else:
                out.append(p if self.calls else self._space + p)
                self._space = ""
        return out
