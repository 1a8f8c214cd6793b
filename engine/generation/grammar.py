"""Grammar-constrained decoding: output that must match a JSON Schema (or be any JSON object), through llguidance.

Three pieces:

- `Grammar`: a compiled, checked grammar (frozen, shared by any number of requests). `json_schema_grammar` and
  `json_object_grammar` make one, raising GenerationError that names what is wrong with a schema.
- The tokenizer bridge: `grammar_tokenizer` hands llguidance Colibri's own tokenizer (its `tokenizers` JSON, the
  model's vocabulary size, the end-of-sequence ids that may end a constrained answer), built once per tokenizer,
  vocabulary size and end set (about a second on a 49k vocabulary) and kept while the tokenizer lives.
  `token_bytes` reads each token's exact bytes from it (what OpenAI's logprobs `bytes` report).
- `Constraint`: one sequence's matcher state, used as the last logits processor of the sampler chain: it sets every
  token the grammar forbids next to -inf (greedy and sampled alike) and `advance`s on the token chosen. Once the
  grammar is complete only an end-of-sequence id stays allowed, so the sequence ends as any other does; before
  that, no end-of-sequence id is allowed. Speculative drafts are verified through the same chain: a drafted token
  is kept only when the constrained choice equals it. Given the request's token budget, it steers the answer to
  close as the budget ends (engine.generation.json_close): only tokens spelling the closing text stay allowed, so
  an answer cut by max_tokens still parses wherever the grammar lets it close.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from engine.errors import GenerationError
from engine.generation.json_close import JsonCloser
from engine.generation.sampling import HistoryKind, TokenIds

try:  # a runtime dependency; imported lazily by nothing else, so a broken install fails only grammar requests
    import llguidance as _llg
except ImportError:  # pragma: no cover - the wheel is in the dependencies
    _llg = None


def _lib() -> Any:
    if _llg is None:
        raise GenerationError("structured output needs the llguidance package: `pip install llguidance`")
    return _llg


# --------------------------------------------------------------------------- grammars


@dataclass(frozen=True)
class Trigger:
    """Where a lazy grammar starts: once the output has written `text` (anywhere, or with `at_start` only as its
    first text past blanks), the grammar constrains what follows it (`kept`: what follows `text` and `text` too)."""

    text: str
    at_start: bool = False
    kept: bool = False


@dataclass(frozen=True)
class Grammar:
    """A checked llguidance grammar and what it asks for (for messages).

    With `triggers` the grammar is lazy (a tool call under tool_choice "auto", or a forced one after reasoning):
    the output is free until a trigger is written, then must match the grammar; once the grammar is done, the
    output is free again (`reopen`, a call that closes with a marker) or may only end."""

    source: str  # llguidance's grammar JSON (LLMatcher.grammar_from_*)
    what: str  # "a JSON object", "JSON matching the schema 'person'"
    triggers: tuple[Trigger, ...] = ()
    reopen: bool = False
    required: bool = False      # lazy: the output may not end before the grammar was triggered and is done
    response_format: str | None = None  # the OpenAI `response_format` (JSON) asking for it, where one does: what a
                                        # client of a remote server sends instead of the grammar


def json_schema_grammar(schema: Any, name: str | None = None) -> Grammar:
    """The grammar of JSON matching `schema` (a JSON Schema as a dict); GenerationError naming the problem."""
    llg = _lib()
    if not isinstance(schema, dict):
        raise GenerationError(f"the JSON schema must be a JSON object, got {type(schema).__name__}")
    try:
        source = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as exc:
        raise GenerationError(f"the JSON schema cannot be read: {exc}") from None
    _check(source, "the JSON schema")
    asked = {"type": "json_schema", "json_schema": {"name": name or "answer", "schema": schema}}
    return Grammar(source, f"JSON matching the schema {name!r}" if name else "JSON matching the schema",
                   response_format=json.dumps(asked, allow_nan=False))


def json_object_grammar() -> Grammar:
    """The grammar of any JSON object (OpenAI's `json_object` response format)."""
    source = _lib().LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}))
    _check(source, "the JSON object grammar")
    return Grammar(source, "a JSON object", response_format=json.dumps({"type": "json_object"}))


def lark_grammar(lark: str, what: str) -> Grammar:
    """A grammar written in llguidance's Lark dialect (`%json {...}` embeds a JSON schema); GenerationError naming
    the problem."""
    try:
        source = _lib().LLMatcher.grammar_from_lark(lark)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise GenerationError(f"{what} cannot be compiled: {exc}") from None
    _check(source, what)
    return Grammar(source, what)


def _check(source: str, what: str) -> None:
    try:
        is_error, messages = _lib().LLMatcher.validate_grammar_with_warnings(source)
    except (TypeError, ValueError, RuntimeError) as exc:    # user input: an answer, never a traceback
        is_error, messages = True, [str(exc)]
    if is_error:
        raise GenerationError(f"{what} is not usable: {messages[0] if messages else 'unknown error'}")


# --------------------------------------------------------------------------- the tokenizer bridge

_bridges: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Any]] = weakref.WeakKeyDictionary()
_bridge_lock = threading.Lock()


def grammar_tokenizer(tokenizer: Any, vocab: int, end_ids: frozenset[int] | None = None) -> Any:
    """llguidance's LLTokenizer for Colibri's `tokenizer` (engine.tokenizer.Tokenizer), masks of `vocab` entries
    (the model's logits, which may be longer than the tokenizer's list) and `end_ids` as the ids that end a
    complete answer (default: the tokenizer's end-of-sequence id). Cached per tokenizer."""
    llg = _lib()
    ends = tuple(sorted(end_ids)) if end_ids else (
        (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    if not ends:
        raise GenerationError("structured output needs an end-of-sequence token, and this model names none")
    with _bridge_lock:
        per = _bridges.setdefault(tokenizer, {})
        found = per.get((vocab, ends))
        if found is None:
            try:
                found = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=list(ends))
            except (ValueError, RuntimeError):
                # a decoder llguidance does not know (Fuse, Replace ...): hand it every token's bytes instead
                try:
                    found = llg.LLTokenizer(llg.TokenizerWrapper(_TokenList(tokenizer, vocab, ends)), n_vocab=vocab,
                                            eos_token=list(ends))
                except (ValueError, RuntimeError) as exc:
                    raise GenerationError(f"the grammar library cannot read this model's tokenizer ({exc}); "
                                          "structured output is not available for it") from None
            per[(vocab, ends)] = found
        return found


class _TokenList:
    """Colibri's tokenizer as llguidance's TokenizerWrapper reads one: each id's bytes, the end and start ids, and
    encoding (of text only: the wrapper finds that out by trying bytes first)."""

    def __init__(self, tokenizer: Any, vocab: int, ends: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = ends[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        n = min(vocab, tokenizer.vocab_size)
        self.tokens = [_piece_bytes(tokenizer, i) for i in range(n)] + [b""] * (vocab - n)

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")
        return self._tokenizer.encode(text, add_special_tokens=False)


def _piece_bytes(tokenizer: Any, token: int) -> bytes:
    """One token's bytes as the tokenizer decodes it alone (a byte-fallback piece `<0xNN>` is that byte)."""
    name = tokenizer.id_to_token(token) or ""
    if len(name) == 6 and name.startswith("<0x") and name.endswith(">"):
        try:
            return bytes([int(name[3:5], 16)])
        except ValueError:
            pass
    return tokenizer.decode([token]).encode("utf-8")


def token_bytes(tokenizer: Any, vocab: int, token: int) -> bytes:
    """The exact bytes of one token (a byte-level piece may be part of a UTF-8 character)."""
    with _bridge_lock:
        known = next(iter(_bridges.get(tokenizer, {}).values()), None)
    bridge = known if known is not None and known.vocab_size == vocab else grammar_tokenizer(tokenizer, vocab)
    return bytes(bridge.decode_bytes([int(token)]))


# --------------------------------------------------------------------------- one sequence's constraint


class Constraint:
    """A grammar's state for one sequence: a logits processor (`__call__`) plus `advance` for the chosen token."""

    wants: ClassVar[HistoryKind] = "generated"  # reads no history: its own state says what may follow

    def __init__(self, grammar: Grammar, bridge: Any, budget: int | None = None, end_ids: frozenset[int] = frozenset()
                 ) -> None:
        llg = _lib()
        self.grammar = grammar
        self.bridge = bridge
        self.left = budget              # tokens the answer may still have (None: no limit known)
        self.end_ids = np.array(sorted(end_ids), dtype=np.int64)
        self.closer = JsonCloser()
        self.matcher = llg.LLMatcher(bridge, grammar.source, log_level=0)
        if self.matcher.is_error():
            raise GenerationError(f"{grammar.what} cannot be matched: {self.matcher.get_error()}")
        self.vocab = int(bridge.vocab_size)
        self._words = np.empty((self.vocab + 31) // 32, dtype=np.int32)  # [W] the mask, one bit per token
        self._allowed = np.empty(self.vocab, dtype=np.bool_)  # [V]

    def __call__(self, logits: np.ndarray, history: TokenIds) -> np.ndarray:
        """Logits with every token the grammar forbids next set to -inf (a new array)."""
        if logits.shape[0] != self.vocab:
            raise GenerationError(f"the grammar was built for {self.vocab} tokens but the model gives "
                                  f"{logits.shape[0]} logits")
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if self.matcher.is_error():
            raise GenerationError(f"the output cannot continue as {self.grammar.what}: {self.matcher.get_error()}")
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")  # [32 W] token i is bit i
        np.copyto(self._allowed, bits[: self.vocab], casting="unsafe")
        if self.left is not None:
            self._steer_to_close()
        return np.where(self._allowed, logits, -np.inf).astype(logits.dtype, copy=False)

    def _steer_to_close(self) -> None:
        """Near the end of the budget, allow only tokens that spell the start of the text closing the JSON so far
        (or an end-of-sequence id once it is whole), where the grammar allows them: an answer cut by max_tokens
        would not parse. Where the grammar allows none of them (a required key still missing), the mask stays."""
        assert self.left is not None
        need = self.closer.suffix()
        if self.left > len(need) + _CLOSE_MARGIN:
            return
        if need:
            pieces = _piece_index(self.bridge)
            ids = [i for k in range(len(need), 0, -1) for i in pieces.get(need[:k], ())]
            keep = np.array(ids, dtype=np.int64)
        else:
            keep = self.end_ids
        keep = keep[self._allowed[keep]] if keep.size else keep
        if keep.size:
            self._allowed[:] = False
            self._allowed[keep] = True

    def advance(self, token: int) -> None:
        """Move past the chosen token; GenerationError if the grammar did not allow it."""
        if not self.matcher.consume_token(int(token)):
            raise GenerationError(f"token {token} does not continue {self.grammar.what}: {self.matcher.get_error()}")
        if self.left is not None:
            self.left -= 1
            self.closer.feed(bytes(self.bridge.decode_bytes([int(token)])))

    @property
    def complete(self) -> bool:
        """Whether the output so far is a whole answer (the grammar accepts it)."""
        return bool(self.matcher.is_accepting())

    @property
    def ended(self) -> bool:
        """Whether the grammar is done and only an end-of-sequence id may follow: an answer cut here by its token
        budget is the whole answer (it finishes "stop", not "length")."""
        return bool(self.matcher.is_stopped())


class LazyConstraint:
    """A lazy grammar's state for one sequence: no mask while the output is free; once a trigger is written, a
    `Constraint` on the rest (fed what the triggering token wrote past the trigger) until its grammar is done."""

    wants: ClassVar[HistoryKind] = "generated"

    def __init__(self, grammar: Grammar, bridge: Any, budget: int | None = None,
                 end_ids: frozenset[int] = frozenset()) -> None:
        self.grammar = grammar
        self.bridge = bridge
        self.left = budget
        self.end_ids = end_ids
        self.active: Constraint | None = None   # the grammar's state while it constrains
        self.calls = 0                          # how many times the grammar was triggered
        self._tail = b""                        # the free output's last bytes, where a trigger may be half written
        self._blank = True                      # nothing but blanks written yet (for `at_start` triggers)
        self._keep = max(len(t.text.encode()) for t in grammar.triggers) - 1

    def __call__(self, logits: np.ndarray, history: TokenIds) -> np.ndarray:
        """The logits, masked by the grammar while a triggered part is being written."""
        if self.active is not None:
            return self.active(logits, history)
        if self.grammar.required and not self.calls and self.end_ids:
            logits = logits.copy()
            logits[list(self.end_ids)] = -np.inf        # the grammar must still be met: no end yet
        return logits

    def advance(self, token: int) -> None:
        """Follow the chosen token: through the grammar while it constrains, else looking for a trigger."""
        if self.left is not None:
            self.left -= 1
        if self.active is not None:
            self.active.advance(token)
            if self.grammar.reopen and self.active.matcher.is_stopped():
                self.active = None
            return
        data = bytes(self.bridge.decode_bytes([int(token)]))
        tail = self._tail + data
        for trigger in self.grammar.triggers:
            text = trigger.text.encode()
            if trigger.at_start:
                lead = tail.lstrip()
                at = len(tail) - len(lead) if self._blank and lead.startswith(text) else -1
            else:
                at = tail.find(text)
            if at >= 0:
                self._start(tail[at if trigger.kept else at + len(text):])
                self._tail, self._blank = b"", False
                return
        self._blank = self._blank and not tail.strip()
        self._tail = tail[len(tail) - self._keep:] if self._keep else b""

    def _start(self, rest: bytes) -> None:
        """Constrain from here on, `rest` (written past the trigger by the same token) already in."""
        ids = list(self.bridge.tokenize_bytes(rest)) if rest else []
        budget = None if self.left is None else self.left + len(ids)
        constraint = Constraint(self.grammar, self.bridge, budget, self.end_ids)
        try:
            for i in ids:
                constraint.advance(i)
        except GenerationError:         # the model began the call its own way: it stays free, and prose
            return
        self.calls += 1
        self.active = None if self.grammar.reopen and constraint.matcher.is_stopped() else constraint

    @property
    def ended(self) -> bool:
        """Whether a triggered part is done and only an end-of-sequence id may follow (never while free)."""
        return self.active is not None and self.active.ended

    @property
    def complete(self) -> bool:
        """Whether the output may end here (not inside a triggered part, nor before a required one)."""
        if self.active is None:
            return bool(self.calls) or not self.grammar.required
        return self.active.complete


def make_constraint(grammar: Grammar, tokenizer: Any, vocab: int, end_ids: frozenset[int],
                    budget: int | None = None) -> Constraint | LazyConstraint:
    """A fresh constraint for one sequence of a model with `vocab` logits, ending on any of `end_ids`; with a
    `budget` (max_tokens), it steers the JSON to close before the budget ends. A lazy grammar (with triggers)
    gives a `LazyConstraint`."""
    if tokenizer is None:
        raise GenerationError("structured output needs the model's tokenizer, and this model has none")
    bridge = grammar_tokenizer(tokenizer, vocab, end_ids)
    if grammar.triggers:
        return LazyConstraint(grammar, bridge, budget, end_ids)
    return Constraint(grammar, bridge, budget, end_ids)


# Closing starts when the tokens left are at most the closing text's bytes plus this: one token may open more
# than it closes (`{"` adds two bytes to close), so a little room is kept.
_CLOSE_MARGIN = 4
_pieces: dict[int, tuple[Any, dict[bytes, list[int]]]] = {}


def _piece_index(bridge: Any) -> dict[bytes, list[int]]:
    """The ids of each token text of `bridge` (built once per bridge, which lives as long as its tokenizer)."""
    with _bridge_lock:
        found = _pieces.get(id(bridge))
        if found is None or found[0] is not bridge:
            index: dict[bytes, list[int]] = {}
            for i in range(int(bridge.vocab_size)):
                index.setdefault(bytes(bridge.decode_bytes([i])), []).append(i)
            found = _pieces[id(bridge)] = (bridge, index)
        return found[1]
