"""Reasoning apart from the answer: split a model's output text, as it streams, into reasoning and answer.

Two formats cover the families Colibri runs:
- "think": reasoning between `<think>` and `</think>` (Qwen3, DeepSeek-R1 and V3.1, GLM-4.5 to 5, MiniMax-M2,
  Kimi K2 Thinking). Some templates open `<think>` in the prompt, so the output starts inside reasoning.
- "harmony" (gpt-oss): messages `<|channel|>NAME<|message|>TEXT<|end|>`, each after `<|start|>ROLE`; the
  `analysis` channel is reasoning, `final` and `commentary` (preambles meant for the user) the answer; a message
  to a function (`to=functions.NAME` in its header, a tool call) goes to the answer verbatim, markers included,
  for engine.tokenizer.tool_calls to read.

Which format applies is read from the chat template and the vocabulary, never from the model's name
(`detect_format`). Where the output starts comes from the rendered prompt itself: the parser reads the prompt
and keeps the state it ends in (`ReasoningFormat.after`). Markers are matched in the text, so their tokens must
be decoded visibly (`ReasoningFormat.marker_ids`: kept even when special tokens are skipped).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
HARMONY_MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
_ENDS = (END, RETURN, CALL)
TO_FUNCTION = "to=functions."      # a harmony header's recipient when the message is a tool call
_REASONING_CHANNELS = frozenset({"analysis"})

# Where a parser is: in the answer, in reasoning, or (harmony) in a message header / between two messages
State = Literal["content", "reasoning", "header", "between"]


@dataclass(frozen=True)
class Split:
    """A piece of output split in two: the reasoning and the answer it holds."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: Split) -> Split:
        return Split(self.reasoning + other.reasoning, self.content + other.content)


@dataclass(frozen=True)
class ReasoningFormat:
    """How a model marks its reasoning, and where its output starts (`start`, set by `after`)."""

    kind: Literal["think", "harmony", "plain"]      # plain: no reasoning, only markers kept visible (tool calls')
    marker_ids: frozenset[int] = frozenset()   # the markers' token ids, decoded even when skipping special tokens
    start: State = "content"

    def after(self, prompt: str) -> ReasoningFormat:
        """This format with `start` set to the state the rendered `prompt` ends in (e.g. inside `<think>`)."""
        parser = self.parser()
        parser.feed(prompt)
        return replace(self, start=parser.state)

    def parser(self) -> ReasoningParser:
        """A fresh incremental parser starting at `start`."""
        if self.kind == "plain":
            return PlainParser()
        return ThinkParser(self.start) if self.kind == "think" else HarmonyParser(self.start)


def detect_format(template: str | Mapping[str, str] | None,
                  token_to_id: Callable[[str], int | None] = lambda _: None) -> ReasoningFormat | None:
    """The reasoning format a chat template uses, or None: harmony when it writes `<|channel|>` and
    `<|message|>`, think when it writes `</think>` (to render or to strip past reasoning)."""
    if template is None:
        return None
    text = template if isinstance(template, str) else "\n".join(template.values())
    if CHANNEL in text and MESSAGE in text:
        kind, markers = "harmony", HARMONY_MARKERS
    elif THINK_CLOSE in text:
        kind, markers = "think", (THINK_OPEN, THINK_CLOSE)
    else:
        return None
    ids = frozenset(i for i in (token_to_id(m) for m in markers) if i is not None)
    return ReasoningFormat(kind, ids)


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could be the start of one of `markers` (held back)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class ReasoningParser:
    """Splits text fed piece by piece into reasoning and answer; `feed` then `flush` once at the end.

    The joined outputs do not depend on how the text was cut. Each section loses its leading newlines, and
    reasoning its trailing ones (templates strip them the same way when they render the history).
    """

    def __init__(self, state: State):
        self.state: State = state
        self._buf = ""            # text not yet classified (a possible marker start, a header)
        self._fresh = True        # at the start of a section: leading newlines are dropped
        self._newlines = ""       # reasoning's trailing newlines, held until more reasoning follows

    def feed(self, text: str) -> Split:
        """Add output text; return what it completes of the reasoning and of the answer."""
        self._buf += text
        return self._scan(final=False)

    def flush(self) -> Split:
        """The end of the output: return whatever was held back."""
        return self._scan(final=True)

    def _scan(self, final: bool) -> Split:
        raise NotImplementedError

    def _switch(self, state: State) -> None:
        self.state, self._fresh, self._newlines = state, True, ""

    def _emit(self, text: str) -> Split:
        """`text` as part of the current section (content or reasoning)."""
        if self._fresh:
            text = text.lstrip("\n")
            self._fresh = not text
        if self.state != "reasoning":
            return Split(content=text)
        text = self._newlines + text
        body = text.rstrip("\n")
        self._newlines = text[len(body):]
        return Split(reasoning=body)


class ThinkParser(ReasoningParser):
    """`<think>reasoning</think>answer`, possibly starting inside the reasoning."""

    def _scan(self, final: bool) -> Split:
        out = Split()
        while True:
            marker = THINK_CLOSE if self.state == "reasoning" else THINK_OPEN
            at = self._buf.find(marker)
            if at < 0:
                keep = 0 if final else _held(self._buf, (marker,))
                out += self._emit(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            out += self._emit(self._buf[:at])
            self._buf = self._buf[at + len(marker):]
            self._switch("content" if self.state == "reasoning" else "reasoning")


class HarmonyParser(ReasoningParser):
    """gpt-oss's harmony messages: `<|start|>ROLE<|channel|>NAME<|message|>TEXT<|end|>` (or `<|return|>`, `<|call|>`)."""

    def __init__(self, state: State):
        super().__init__(state)
        self._channel = ""
        self._call = False        # in a message to a function (a tool call)

    def _scan(self, final: bool) -> Split:
        out = Split()
        while True:
            if self.state == "header":
                at = self._buf.find(MESSAGE)
                if at < 0:
                    if final:    # an unfinished header is dropped; text that never used the format is the answer
                        text = self._buf if not any(m in self._buf for m in HARMONY_MARKERS) else ""
                        self._buf = ""
                        self.state = "content"
                        out += self._emit(text)
                    return out
                header, self._buf = self._buf[:at], self._buf[at + len(MESSAGE):]
                self._channel = _channel_of(header)
                self._switch("reasoning" if self._channel in _REASONING_CHANNELS else "content")
                self._call = TO_FUNCTION in header
                if self._call:      # a tool call: passed on whole, for engine.tokenizer.tool_calls to read
                    out += Split(content=START + header + MESSAGE)
                continue
            # inside a message (reasoning or content) or between messages: look for the next marker
            hits = [(self._buf.find(m), m) for m in (*_ENDS, START, CHANNEL)]
            hits = [(at, m) for at, m in hits if at >= 0]
            if not hits:
                keep = 0 if final else _held(self._buf, HARMONY_MARKERS)
                piece = self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                if self.state != "between":
                    out += self._emit(piece)
                elif piece.strip():          # stray text between messages still reaches the user
                    self._switch("content")
                    out += self._emit(piece)
                return out
            at, marker = min(hits)
            if self.state != "between" or self._buf[:at].strip():
                if self.state == "between":
                    self._switch("content")
                out += self._emit(self._buf[:at])
            if marker in _ENDS:
                if self._call:
                    out += Split(content=marker)
                    self._call = False
                self._buf = self._buf[at + len(marker):]
                self._switch("between")
            else:   # a new header: after <|start|> the role, or straight to <|channel|>
                self._buf = self._buf[at + (len(START) if marker == START else 0):]
                self._switch("header")


class PlainParser(ReasoningParser):
    """No reasoning format: all text is the answer, passed on as it comes."""

    def __init__(self) -> None:
        super().__init__("content")

    def _scan(self, final: bool) -> Split:
        text, self._buf = self._buf, ""
        return Split(content=text)


def open_parser(fmt: ReasoningFormat | None) -> ReasoningParser:
    """A parser for `fmt`, or one that passes all text on as the answer when there is no format."""
    return fmt.parser() if fmt is not None else PlainParser()


def _channel_of(header: str) -> str:
    """The channel a harmony header names (`assistant<|channel|>analysis` -> "analysis")."""
    at = header.find(CHANNEL)
    if at < 0:
        return ""
    rest = header[at + len(CHANNEL):]
    for stop in (" ", "<|"):
        rest = rest.split(stop, 1)[0]
    return rest.strip()
