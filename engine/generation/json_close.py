"""The shortest text that closes a JSON prefix: what a constrained answer steers towards as its token budget ends.

`JsonCloser` follows the bytes of a JSON text as they are generated (containers open, whether a string, number or
literal is half written, whether an object waits for a key, a colon or a value) and `suffix()` gives the text that
ends it: close the string, finish the literal, give a pending key the value null, close every container. It judges
JSON syntax only: a schema's required keys are the grammar's business (the mask still decides what may follow).
"""

from __future__ import annotations

_LITERALS = (b"true", b"false", b"null")
_BACKSLASH = -1


class JsonCloser:
    """A JSON prefix's state, fed byte by byte (`feed`), and the text that would close it (`suffix`)."""

    def __init__(self) -> None:
        # one frame per open container: [b"{" or b"[", what it waits for]; an object waits for "key0" (a key or
        # "}"), "key" (a key, after a comma), "colon", "value" or "next" ("," or the close), an array for
        # "value0" (a value or "]"), "value" or "next"
        self.stack: list[list] = []
        self.string: bool = False   # inside a string
        self.key: bool = False      # ... which is an object's key
        self.escape: int = 0        # hex digits of a "\u" escape still to come, or _BACKSLASH right after "\"
        self.scalar = b""           # a number or literal being written

    def feed(self, data: bytes) -> None:
        """Follow more of the text."""
        for c in data:
            self._byte(bytes([c]))

    def _byte(self, b: bytes) -> None:
        if self.string:
            if self.escape == _BACKSLASH:
                self.escape = 4 if b == b"u" else 0
            elif self.escape:
                self.escape -= 1
            elif b == b"\\":
                self.escape = _BACKSLASH
            elif b == b'"':
                self.string = False
                self._done_value(key=self.key)
            return
        if self.scalar:
            if b.isalnum() or b in b"+-.":
                self.scalar += b
                return
            self.scalar = b""
            self._done_value()
        if b in b" \t\r\n":
            return
        top = self.stack[-1] if self.stack else None
        if b in b"{[":
            self._begin_value()
            self.stack.append([b, "key0" if b == b"{" else "value0"])
        elif b in b"}]":
            if self.stack:
                self.stack.pop()
            self._done_value()
        elif b == b'"':
            self.key = top is not None and top[0] == b"{" and top[1] in ("key0", "key")
            if not self.key:
                self._begin_value()
            self.string = True
        elif b == b":":
            if top is not None:
                top[1] = "value"
        elif b == b",":
            if top is not None:
                top[1] = "key" if top[0] == b"{" else "value"
        else:
            self._begin_value()
            self.scalar = b

    def _begin_value(self) -> None:
        top = self.stack[-1] if self.stack else None
        if top is not None and top[0] == b"[":
            top[1] = "value"

    def _done_value(self, key: bool = False) -> None:
        if self.stack:
            self.stack[-1][1] = "colon" if key else "next"

    def suffix(self) -> bytes:
        """The text that makes the prefix a whole JSON value (b"" when it already is one)."""
        out = b""
        frames = [list(f) for f in self.stack]
        if self.string:
            out += b"n" if self.escape == _BACKSLASH else b"0" * self.escape
            out += b'"'
            if frames:
                frames[-1][1] = "colon" if self.key else "next"
        elif self.scalar:
            out += _finish_scalar(self.scalar)
            if frames:
                frames[-1][1] = "next"
        for depth, (kind, wait) in enumerate(reversed(frames)):
            if depth:
                wait = "next"       # the container just closed was this one's value
            if kind == b"{":
                out += {"key": b'"":null', "colon": b":null", "value": b"null"}.get(wait, b"") + b"}"
            else:
                out += (b"null" if wait == "value" else b"") + b"]"
        return out


def _finish_scalar(s: bytes) -> bytes:
    """What completes a half-written number or literal."""
    for lit in _LITERALS:
        if lit.startswith(s):
            return lit[len(s):]
    return b"0" if s[-1:] in (b"-", b"+", b".", b"e", b"E") else b""
