"""Incremental detokenization: text for a stream of token ids, one id at a time.

Byte-level and byte-fallback vocabularies split one character across several tokens, and some
decoders treat the start of the text specially (SentencePiece drops its leading "▁"). So a token's
text is not simply decode([id]). The decoder keeps a small window: the ids whose text was emitted
last (the context) and the ids after them; it decodes the window and emits what the new ids added,
once that text is stable: it does not end in an incomplete UTF-8 sequence (U+FFFD) and no
byte-fallback token run is still open (a later byte can turn a complete run invalid).
The outputs of push() joined with flush() equal decode() of all the ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
_WHOLE_HOLD_BACK = 8  # characters kept back in whole-sequence mode (longer than any cleanup pattern)


class StreamDecoder:
    """Turns token ids into text as they arrive; see the module docstring for the guarantee."""

    def __init__(self, decode: Callable[[Sequence[int]], str], hold_ids: frozenset[int] = frozenset(),
                 windowed: bool = True, invisible_ids: frozenset[int] = frozenset()) -> None:
        self._decode = decode
        self._hold = hold_ids  # byte-fallback tokens: text waits until their run ends
        # Ids that decode() drops (special tokens when skipping them): they do not end a byte run
        self._invisible = invisible_ids
        self._run_open = False  # the last visible id is a byte-fallback token
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids[prefix:read] produced the last emitted text
        self._read = 0  # ids[:read] have all their text emitted
        self._prefix_text = ""  # decode(ids[prefix:read]), the window's context
        # Decoders whose output is not a plain concatenation past a context window (word-piece
        # cleanup, unknown decoders) are run on the whole sequence instead: slower but exact.
        self._windowed = windowed
        self._emitted: str = ""  # only kept in whole-sequence mode

    @property
    def token_ids(self) -> list[int]:
        """The ids pushed so far (a copy)."""
        return list(self._ids)

    def push(self, token_id: int) -> str:
        """Add one token id; return the text it completed (often "", never a partial character)."""
        self._ids.append(int(token_id))
        if token_id not in self._invisible:
            self._run_open = token_id in self._hold
        if self._run_open:
            return ""
        return self._advance(final=False)

    def flush(self) -> str:
        """Return whatever text is still held back (call once the sequence ends)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if not self._windowed:
            return self._advance_whole(final)
        text = self._decode(self._ids[self._prefix:])
        if not final and text.endswith(REPLACEMENT):
            return ""
        if not text.startswith(self._prefix_text):
            # The decoder rewrote the context itself: from here on decode the whole sequence
            self._windowed = False
            self._emitted = self._decode(self._ids[: self._read])
            return self._advance_whole(final)
        new = text[len(self._prefix_text):]
        if new:
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        return new

    def _advance_whole(self, final: bool) -> str:
        text = self._decode(self._ids)
        if not final:
            # Cleanup rules rewrite a few characters around the join with the next token (" ' " -> "'"),
            # so the last few characters wait for it.
            text = text[:-_WHOLE_HOLD_BACK]
            if text.endswith(REPLACEMENT):
                return ""
        if not text.startswith(self._emitted):
            return ""  # cannot take back what was emitted; nothing better to do than wait
        new = text[len(self._emitted):]
        self._emitted += new
        self._read = len(self._ids)
        return new
