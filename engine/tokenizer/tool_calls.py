"""Tool calls in a model's answer: which format a chat template asks for, and the answer's text split into prose
and structured calls, as it streams.

Seven formats cover the families Colibri runs, each read from what the chat template writes (never the model's
name, `detect_tool_format`):
- "hermes" (Qwen, Hermes, MiniMax's `<tool_call>` kin): `<tool_call>{"name": N, "arguments": {...}}</tool_call>`;
- "glm" (GLM-4.5 to 4.7): `<tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`, a value
  being JSON unless the tool's schema says string;
- "llama3": the whole answer is `{"name": N, "parameters": {...}}` (or `"arguments"`), optionally after
  `<|python_tag|>`, several calls joined by `;`;
- "harmony" (gpt-oss): a message `<|start|>assistant<|channel|>commentary to=functions.N <|constrain|>json
  <|message|>{...}<|call|>`. The reasoning parser (engine.tokenizer.reasoning) passes such a message on to the
  answer verbatim, so this parser reads it from the answer like the others;
- "deepseek" (DeepSeek V3, R1, V3.1): `<｜tool▁calls▁begin｜>` then calls, `<｜tool▁calls▁end｜>`; a call is
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>N\n```json\n{...}\n```<｜tool▁call▁end｜>` (V3, R1) or
  `<｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` (V3.1);
- "kimi" (Kimi K2): `<|tool_calls_section_begin|>` then calls `<|tool_call_begin|>functions.N:I
  <|tool_call_argument_begin|>{...}<|tool_call_end|>`, `<|tool_calls_section_end|>`;
- "minimax" (MiniMax-M2): `<minimax:tool_call>` then `<invoke name="N"><parameter name="K">V</parameter>...
  </invoke>` calls, `</minimax:tool_call>`, a value being JSON unless the tool's schema says string (as GLM's).

The last three write several calls in one section, which is read whole when it closes.

The parser works on the answer (reasoning already split off): a call written while reasoning is a thought, not a
call. Text that looks like a call but does not parse stays prose: nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.tokenizer.reasoning import CALL, CHANNEL, MESSAGE, START

ToolFormat = Literal["hermes", "glm", "llama3", "harmony", "deepseek", "kimi", "minimax"]

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
PYTHON_TAG = "<|python_tag|>"
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KIMI_CALLS, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MM_CALLS, MM_CALLS_END = "<minimax:tool_call>", "</minimax:tool_call>"

# The strings of each format a decoder must show even when they are special tokens
MARKERS: dict[ToolFormat, tuple[str, ...]] = {
    "hermes": (TOOL_OPEN, TOOL_CLOSE),
    "glm": (TOOL_OPEN, TOOL_CLOSE, ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END),
    "llama3": (),            # <|python_tag|> may stay hidden: the JSON alone is the call
    "harmony": (),           # the reasoning format keeps harmony's markers already
    "deepseek": (DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP),
    "kimi": (KIMI_CALLS, KIMI_CALLS_END, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END),
    "minimax": (MM_CALLS, MM_CALLS_END),
}
# the markers around a call (or, for the formats writing calls in a section, around the section)
_BOUNDS: dict[str, tuple[str, str]] = {"hermes": (TOOL_OPEN, TOOL_CLOSE), "glm": (TOOL_OPEN, TOOL_CLOSE),
                                       "harmony": (START, CALL), "deepseek": (DS_CALLS, DS_CALLS_END),
                                       "kimi": (KIMI_CALLS, KIMI_CALLS_END), "minimax": (MM_CALLS, MM_CALLS_END)}

_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def arguments_json(self) -> str:
        """The arguments as a JSON string (OpenAI's `function.arguments`)."""
        return json.dumps(self.arguments, ensure_ascii=False)


Piece = str | ToolCall


def detect_tool_format(template: str | Mapping[str, str] | None) -> ToolFormat | None:
    """The tool-call format a chat template teaches its model, or None when it renders no tools."""
    if template is None:
        return None
    text = template if isinstance(template, str) else "\n".join(template.values())
    if DS_CALLS in text and DS_SEP in text:
        return "deepseek"
    if KIMI_CALLS in text and KIMI_ARGS in text:
        return "kimi"
    if MM_CALLS in text and "<invoke name=" in text:
        return "minimax"
    if TOOL_OPEN in text and ARG_KEY in text:
        return "glm"
    if CHANNEL in text and MESSAGE in text and "to=" in text and "functions." in text:
        return "harmony"
    if TOOL_OPEN in text:
        return "hermes"
    if PYTHON_TAG in text or ("<|start_header_id|>" in text and '"parameters"' in text):
        return "llama3"
    return None


def parse_tool_calls(fmt: ToolFormat, text: str, schemas: Mapping[str, Mapping] | None = None
                     ) -> tuple[str, list[ToolCall]]:
    """A whole answer split into its prose (the calls cut out) and its calls."""
    parser = ToolCallParser(fmt, schemas)
    pieces = parser.feed(text) + parser.flush()
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)]


def _held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class ToolCallParser:
    """Splits answer text fed piece by piece into prose and calls; `feed` then `flush` once at the end.

    Prose passes on as it comes, but for the end of a piece that could start a call's marker (held back). A call
    is given whole once its closing marker (or the end of the answer) arrives. `schemas` (tool name -> JSON
    schema of its parameters) tells GLM's string values from JSON ones.
    """

    def __init__(self, fmt: ToolFormat, schemas: Mapping[str, Mapping] | None = None):
        self.fmt = fmt
        self.schemas = dict(schemas or {})
        self._buf = ""
        self._inside = False        # within a call's markers (or, llama3, within a JSON answer)
        self._started = False       # llama3: the answer's first visible character has been seen

    def feed(self, text: str) -> list[Piece]:
        """Add answer text; return the prose and calls it completes."""
        self._buf += text
        return self._scan(final=False)

    def flush(self) -> list[Piece]:
        """The end of the answer: an unclosed call is parsed if it can be, else given back as prose."""
        return self._scan(final=True)

    # --- the formats

    def _scan(self, final: bool) -> list[Piece]:
        if self.fmt == "llama3":
            return self._scan_json(final)
        opening, closing = _BOUNDS[self.fmt]
        out: list[Piece] = []
        while True:
            if not self._inside:
                at = self._buf.find(opening)
                if at < 0:
                    keep = 0 if final else _held(self._buf, opening)
                    out.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return [p for p in out if p != ""]
                out.append(self._buf[:at])
                self._buf = self._buf[at:]
                self._inside = True
            at = self._buf.find(closing, len(opening))
            while at >= 0 and self.fmt == "hermes" and _in_string(self._buf[len(opening):at]):
                at = self._buf.find(closing, at + 1)      # the marker is written inside an argument's string
            if at < 0 and not final:
                return [p for p in out if p != ""]
            end = len(self._buf) if at < 0 else at + len(closing)
            raw, self._buf = self._buf[:end], self._buf[end:]
            self._inside = False
            body = raw[len(opening): at if at >= 0 else len(raw)]
            calls = self._body(body)
            if calls is None:
                out.append(raw)
            else:
                out.extend(calls)
            if at < 0:
                return [p for p in out if p != ""]

    def _body(self, body: str) -> list[ToolCall] | None:
        """The calls between a call's (or a section's) markers, or None when they do not parse."""
        if self.fmt in ("deepseek", "kimi", "minimax"):
            return self._section(body)
        call = self._harmony(body) if self.fmt == "harmony" else \
            self._glm(body) if self.fmt == "glm" else self._hermes(body)
        return None if call is None else [call]

    def _section(self, body: str) -> list[ToolCall] | None:
        """The calls of a section (none parses: None); text between calls other than blanks fails it."""
        if self.fmt == "minimax":
            pattern = _MM_INVOKE
        else:
            begin, end = (DS_CALL, DS_CALL_END) if self.fmt == "deepseek" else (KIMI_CALL, KIMI_CALL_END)
            pattern = re.compile(re.escape(begin) + r"(.*?)(?:" + re.escape(end) + r"|$)", re.S)
        calls, pos = [], 0
        for m in pattern.finditer(body):
            if body[pos:m.start()].strip() or not m.group(0):
                return None
            call = self._minimax(m.group(1), m.group(2)) if self.fmt == "minimax" else \
                self._deepseek(m.group(1)) if self.fmt == "deepseek" else self._kimi(m.group(1))
            if call is None:
                return None
            calls.append(call)
            pos = m.end()
            if pos == len(body):
                break
        if body[pos:].strip() or not calls:
            return None
        return calls

    def _deepseek(self, body: str) -> ToolCall | None:
        head, sep, rest = body.partition(DS_SEP)
        if not sep:
            return None
        fenced = re.fullmatch(r"([^\n`]+)\n```(?:json)?\n(.*)\n```\s*", rest, re.S)
        if fenced:                                   # V3 and R1: type, name, then the arguments fenced
            name, args = fenced.group(1).strip(), _json_object(fenced.group(2))
        else:                                        # V3.1: the name, then the arguments
            name, args = head.strip(), _json_object(rest.strip())
        return ToolCall(name, args) if name and args is not None else None

    def _kimi(self, body: str) -> ToolCall | None:
        head, sep, rest = body.partition(KIMI_ARGS)
        # the call's id is functions.NAME:INDEX
        name = re.fullmatch(r"\s*(?:functions\.)?([^\s:<>]+)(?::\d+)?\s*", head)
        args = _json_object(rest.strip()) if sep else None
        return ToolCall(name.group(1), args) if name and args is not None else None

    def _minimax(self, name: str, body: str) -> ToolCall | None:
        props = _properties(self.schemas.get(name))
        args: dict[str, Any] = {}
        pos = 0
        for m in _MM_PARAM.finditer(body):
            if body[pos:m.start()].strip():
                return None
            args[m.group(1)] = _typed(m.group(2), props.get(m.group(1)))
            pos = m.end()
        return ToolCall(name, args) if not body[pos:].strip() else None

    def _hermes(self, body: str) -> ToolCall | None:
        value = _json_object(body.strip())
        if value is None or not isinstance(value.get("name"), str):
            return None
        args = value.get("arguments", value.get("parameters", {}))
        if isinstance(args, str):       # some models write the arguments as a JSON string
            args = _json_object(args)
        return ToolCall(value["name"], args) if isinstance(args, dict) else None

    def _glm(self, body: str) -> ToolCall | None:
        name, _, rest = body.partition(ARG_KEY)
        name = name.strip()
        if not name or any(c in name for c in "<>{}\n"):
            return None
        props = _properties(self.schemas.get(name))
        args: dict[str, Any] = {}
        rest = ARG_KEY + rest if rest else ""
        pattern = re.compile(re.escape(ARG_KEY) + r"(.*?)" + re.escape(ARG_KEY_END) + r"\s*" + re.escape(ARG_VALUE)
                             + r"(.*?)" + re.escape(ARG_VALUE_END), re.S)
        pos = 0
        for m in pattern.finditer(rest):
            if rest[pos:m.start()].strip():
                return None
            key = m.group(1).strip()
            args[key] = _typed(m.group(2), props.get(key))
            pos = m.end()
        if rest[pos:].strip():
            return None
        return ToolCall(name, args)

    def _harmony(self, body: str) -> ToolCall | None:
        header, sep, message = body.partition(MESSAGE)
        recipient = _RECIPIENT.search(header)
        if not sep or recipient is None:
            return None
        args = _json_object(message.strip())
        return ToolCall(recipient.group(1), args) if args is not None else None

    def _scan_json(self, final: bool) -> list[Piece]:
        # Llama 3 writes a call as the whole answer: prose passes on unless the answer opens with "{"
        if not self._started:
            stripped = self._buf.lstrip()
            if stripped.startswith(PYTHON_TAG):
                stripped = stripped[len(PYTHON_TAG):].lstrip()
            if not stripped or (not final and PYTHON_TAG.startswith(stripped)):
                if final:
                    text, self._buf = self._buf, ""
                    return [text] if text else []
                return []
            self._started = True
            self._inside = stripped.startswith("{")
        if not self._inside or not final:
            if self._inside:
                return []
            text, self._buf = self._buf, ""
            return [text] if text else []
        raw, self._buf = self._buf, ""
        body = raw.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):]
        calls = []
        for part in _split_top_level(body, ";"):
            call = self._hermes(part)
            if call is None:
                return [raw]
            calls.append(call)
        return calls or [raw]


_MM_INVOKE = re.compile(r'<invoke name="([^"]*)">(.*?)</invoke>', re.S)
_MM_PARAM = re.compile(r'<parameter name="([^"]*)">(.*?)</parameter>', re.S)


def _typed(value: str, kind: object) -> Any:
    """An argument value written bare (GLM's, MiniMax's): a string where the schema says so, else JSON if it is."""
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:      # the templates write strings bare: a value that is no JSON is one
        return value


def _properties(schema: object) -> dict[str, object]:
    """A JSON schema's property names -> their `type` (what a client sent may be any JSON)."""
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    if not isinstance(props, Mapping):
        return {}
    return {k: v.get("type") if isinstance(v, Mapping) else None for k, v in props.items()}


def _in_string(text: str) -> bool:
    """Whether JSON text ends inside a string."""
    quoted, escaped = False, False
    for c in text:
        if escaped:
            escaped = False
        elif c == "\\" and quoted:
            escaped = True
        elif c == '"':
            quoted = not quoted
    return quoted


def _split_top_level(text: str, sep: str) -> list[str]:
    """`text` cut at each `sep` outside JSON strings and brackets."""
    parts, depth, quoted, escaped, start = [], 0, False, False, 0
    for i, c in enumerate(text):
        if quoted:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                quoted = False
            continue
        if c == '"':
            quoted = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]
