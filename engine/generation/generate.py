"""Generation as a chain of generators: `generate_step` yields token ids, `stream_generate` turns
them into typed events (text deltas, stop handling, stats) that every front end consumes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterator, Sequence

import numpy as np

from engine.errors import ColibriError, GenerationError
from engine.events import (
    DoneEvent,
    ErrorEvent,
    Event,
    GenerationStats,
    ProgressEvent,
    PromptLogitsEvent,
    TokenEvent,
)
from engine.generation.grammar import Constraint, Grammar, LazyConstraint, make_constraint
from engine.generation.prefill import prefill, prefill_chunks
from engine.generation.sampling import (
    History,
    SamplingParams,
    apply_processors,
    make_logits_processors,
    make_sampler,
    token_logprobs,
)
from engine.generation.speculative import (
    DraftModel,
    HiddenStateDrafter,
    SpeculationController,
    SpeculativeSettings,
    make_drafter,
    verify,
)
from engine.kv import KEEP_STEP, KVCache, KVFullError
from engine.models.transformer import Transformer
from engine.tokenizer.detokenize import StreamDecoder
from engine.tokenizer.reasoning import ReasoningFormat, open_parser
from engine.tokenizer.text import clean_text


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate from a tokenized prompt."""

    prompt: tuple[int, ...]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()                # stop strings (not included in the output)
    stop_ids: frozenset[int] | None = None    # None: the model's end-of-sequence ids
    prompt_logits: bool = False               # send the prompt's logits [T, V] as an event
    skip_special_tokens: bool = True          # leave control tokens out of the text
    speculative: SpeculativeSettings | None = None  # draft and verify several tokens per pass (same output)
    reasoning: ReasoningFormat | None = None  # split the text into reasoning and answer (a chat's prompt decides)
    logprobs: int | None = None               # each token's log-probability and this many alternatives (None: off)
    grammar: Grammar | None = None            # the output must match it (engine.generation.grammar); None: free text


class Seen:
    """Prompt then generated ids in one int array grown by doubling (the processors' history)."""

    def __init__(self, prompt: Sequence[int]):
        self.ids = np.zeros(len(prompt) + 64, np.int64)
        self.ids[: len(prompt)] = prompt
        self.n, self.n_prompt = len(prompt), len(prompt)

    def append(self, token: int) -> None:
        if self.n == self.ids.size:
            self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
        self.ids[self.n] = token
        self.n += 1

    def view(self) -> np.ndarray:
        """The ids so far [n] (a view: valid until the next append)."""
        return self.ids[: self.n]


def draft_room(cache: KVCache, k: int, made: int, limit: int | None) -> int:
    """How many draft tokens this step may verify without changing what plain decoding would do.

    The verify pass must not overflow the cache (eviction and retention would then differ) and
    must leave the cache below max_len while any produced token is still being consumed, which
    is what `stream_generate` checks; past `limit` tokens drafting is wasted work.
    """
    if cache.overflow != "error" or cache.tracking:
        return 0
    room = min(k, cache.max_len - cache.length - 2)
    if cache.states:        # a recurrent layer rolls back only within a step of at most KEEP_STEP tokens
        room = min(room, KEEP_STEP - 1)
    if limit is not None:
        room = min(room, limit - made - 1)
    return max(room, 0)


def generate_step(
    model: Transformer,
    prompt: Sequence[int],
    cache: KVCache,
    sampling: SamplingParams,
    *,
    first_logits: np.ndarray | None = None,
    first_hidden: np.ndarray | None = None,
    speculative: SpeculativeSettings | None = None,
    controller: SpeculationController | None = None,
    limit: int | None = None,
    scored: Callable[[np.ndarray, int], None] | None = None,
    constraint: Constraint | LazyConstraint | None = None,
) -> Generator[int, None, None]:
    """Yield sampled token ids forever; the consumer stops iterating when it has enough.

    `first_logits` are the prompt's last logits when the caller ran the prefill itself (with an MTP
    drafter, `first_hidden` then holds the prompt's hidden states before the final norm [T, hidden]). With
    `speculative`, drafts are verified several tokens per forward pass; the ids are the same.
    `controller` (made from `speculative` when None) holds the drafting counters; `limit` is the
    number of tokens the consumer will take at most (drafting stops short of it). While the
    consumer holds a token, `cache` holds everything before it, as in plain decoding; a consumer
    that stops mid-draft leaves it so (the closed generator truncates the accepted draft's tail).
    `scored(logits, token)` sees each chosen token with the raw logits [V] it was chosen from (before the
    processors), in order, as it is chosen (with drafts, before it is yielded). `constraint` masks what its grammar
    forbids (the last processor) and follows each chosen token: a drafted token is kept only when the constrained
    choice equals it, so speculative output obeys the grammar as plain decoding does.
    """
    sampler = make_sampler(sampling)
    processors = make_logits_processors(sampling)
    if constraint is not None:
        processors.append(constraint)
    drafter = None
    if speculative is not None:
        drafter = make_drafter(speculative, model.spec.vocab_size, cache.max_len)
        controller = controller if controller is not None else SpeculationController(speculative)
    # an MTP drafter reads the main model's hidden states of every verified position (the prompt's too)
    observe: Callable[[int, np.ndarray], None] | None = \
        drafter.observe if isinstance(drafter, HiddenStateDrafter) else None
    hidden: list[np.ndarray] | None = [] if observe is not None else None
    origin = cache.length                    # the prompt's first position: the drafter counts from it
    if first_logits is None:
        logits = prefill(model, prompt, cache, hidden=hidden)
    else:
        logits = first_logits
        if hidden is not None:
            if first_hidden is None:
                close_drafters(drafter)
                raise GenerationError("MTP drafting needs the prompt's hidden states: pass first_hidden with "
                                      "first_logits (or let generate_step run the prefill)")
            origin = cache.length - len(first_hidden)
            hidden.append(first_hidden)
    if observe is not None and hidden:
        observe(0, np.concatenate(hidden))          # [prompt, hidden]
    seen = Seen(prompt)
    tel = model.context.telemetry

    def choose(row: np.ndarray) -> int:
        with tel.phase("sampling"):
            raw = row
            if processors:
                row = apply_processors(row, History(seen.view(), seen.n_prompt), processors)
            token = sampler(row)
            if constraint is not None:
                constraint.advance(token)
            if scored is not None:
                scored(raw, token)
        seen.append(token)
        return token

    try:
        token = choose(logits)
        yield token
        made = 1
        while True:
            if drafter is None:
                token = choose(model.forward([token], cache)[-1])
                made += 1
                yield token
                continue
            assert controller is not None and speculative is not None   # set with the drafter
            t0 = controller.clock()
            k = draft_room(cache, speculative.max_draft, made, limit) if controller.want_draft() else 0
            draft = _in_vocab(drafter.propose(seen.view(), k)[:k], model.spec.vocab_size) if k else []
            base = cache.length
            # while drafting is off, plain steps keep the fused step (which hands out no hidden states): an MTP
            # drafter restarts from the first pass it sees again
            watch = hidden if hidden is not None and controller.on else None
            if watch is not None:
                watch.clear()
            try:
                rows = model.forward([token, *draft], cache, all_logits=bool(draft), hidden=watch)  # [1 + k, V]
            except KVFullError:
                if not draft:
                    raise
                cache.truncate(base)        # a shared pool short of blocks for the draft: decode plainly
                if watch is not None:
                    watch.clear()
                draft, rows = [], model.forward([token], cache, hidden=watch)
            out = verify(rows, draft, choose) if draft else [choose(rows[-1])]
            if draft:
                cache.truncate(base + len(out))     # the last token and the accepted drafts
            if observe is not None and watch:
                observe(base - origin, watch[-1][: len(out)])    # [len(out), hidden]: the verified rows
            controller.record(len(draft), len(out) - 1, len(out), controller.clock() - t0)
            for i, token in enumerate(out):
                made += 1
                try:
                    yield token
                except GeneratorExit:
                    if draft:
                        cache.truncate(base + 1 + i)    # as plain decoding holds it at this token
                    raise
    finally:
        if speculative is not None and speculative.drafter is None:   # drafters made here, not the caller's
            close_drafters(drafter)


def _in_vocab(draft: list[int], vocab: int) -> list[int]:
    """The draft up to its first id outside the vocabulary (a draft model's may be larger)."""
    for i, t in enumerate(draft):
        if not 0 <= t < vocab:
            return draft[:i]
    return list(draft)


def close_drafters(drafter) -> None:
    """Release the draft models' and MTP drafter's caches (prompt lookup holds nothing)."""
    for d in getattr(drafter, "drafters", [drafter]):
        if isinstance(d, (DraftModel, HiddenStateDrafter)):
            d.close()


class StopStrings:
    """Holds back text that may be the start of a stop string; reports when one completes."""

    def __init__(self, stops: Sequence[str]):
        # cleaned as prompts are (engine.tokenizer.text), so "\ud800" stops where the text has U+FFFD
        self.stops = [clean_text(s) for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return what is safe to emit and whether a stop string was hit."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        """Whatever was held back, at the end of generation."""
        out, self.pending = self.pending, ""
        return out


def stream_generate(
    model: Transformer,
    tokenizer,
    request: GenerationRequest,
    *,
    stop_ids: frozenset[int] = frozenset(),
    cache: KVCache | None = None,
    cancel: threading.Event | None = None,
    speculation: SpeculationController | None = None,
) -> Iterator[Event]:
    """Generate for one request as a stream of events, ending with DoneEvent or ErrorEvent.

    `tokenizer` may be None (token ids only: texts are then empty). `speculation` receives the
    drafting counters when the request is speculative (the caller reads them afterwards).
    """
    t0 = time.perf_counter()
    prompt = list(request.prompt)
    cache = cache if cache is not None else KVCache(model.spec)
    chunks: list[np.ndarray] = []
    # the prompt's hidden states, for an MTP drafter (it reads every verified position's)
    prompt_hidden: list[np.ndarray] | None = [] if request.speculative is not None and request.speculative.mtp is not None else None
    try:
        request.sampling.validate()
        if request.speculative is not None:
            request.speculative.validate()
        if request.max_tokens < 1:
            raise GenerationError(f"max_tokens is {request.max_tokens}; it must be at least 1")
        if request.logprobs is not None and request.logprobs < 0:
            raise GenerationError(f"logprobs asks for {request.logprobs} alternatives; give 0 or more")
        if len(prompt) + cache.length >= cache.max_len:
            raise GenerationError(
                f"the prompt has {len(prompt)} tokens but the context holds {cache.max_len} "
                f"(with {cache.length} already used); shorten the prompt or raise --ctx"
            )
        for done, logits in prefill_chunks(model, prompt, cache, all_logits=request.prompt_logits, hidden=prompt_hidden):
            chunks.append(logits)
            yield ProgressEvent(done, len(prompt))
            if cancel is not None and cancel.is_set() and done < len(prompt):
                t = time.perf_counter() - t0
                yield DoneEvent("cancelled", (), "", GenerationStats(done, 0, t, 0.0, 0.0))
                return
    except ColibriError as exc:
        yield ErrorEvent(str(exc))
        return
    if request.prompt_logits:
        yield PromptLogitsEvent(np.concatenate(chunks))
    logits = chunks[-1][-1]
    t_prefill = time.perf_counter()
    stops = request.stop_ids if request.stop_ids is not None else stop_ids
    decoder = request_decoder(tokenizer, request)
    matcher = StopStrings(request.stop)
    splitter = open_parser(request.reasoning)
    tokens: list[int] = []
    text: list[str] = []
    thought: list[str] = []
    reason, hit, sampled = "length", False, 0
    t_first = t_last = t_prefill
    scores: deque[tuple[float, tuple[tuple[int, float], ...]]] = deque()   # chosen, not yet yielded
    try:
        constraint = make_constraint(request.grammar, tokenizer, model.spec.vocab_size, stops,
                                     request.max_tokens) \
            if request.grammar is not None else None
    except ColibriError as exc:
        yield ErrorEvent(str(exc))
        return
    n_top = request.logprobs

    def score(row: np.ndarray, token: int) -> None:
        scores.append(token_logprobs(row, token, n_top or 0))

    steps = generate_step(model, prompt, cache, request.sampling, first_logits=logits,
                          first_hidden=np.concatenate(prompt_hidden) if prompt_hidden else None,
                          speculative=request.speculative, controller=speculation, limit=request.max_tokens,
                          scored=score if n_top is not None else None, constraint=constraint)
    try:
        for token in steps:
            t_last = time.perf_counter()
            if sampled == 0:
                t_first = t_last
            sampled += 1
            lp, alts = scores.popleft() if scores else (None, ())
            if token in stops:
                reason = "stop"
                break
            tokens.append(token)
            delta, hit = matcher.feed(decoder.push(token) if decoder else "")
            part = splitter.feed(delta)
            text.append(part.content)
            thought.append(part.reasoning)
            yield TokenEvent(len(tokens) - 1, token, part.content, part.reasoning, lp, alts)
            if hit:
                reason = "stop"
                break
            if len(tokens) >= request.max_tokens or cache.length >= cache.max_len:
                if constraint is not None and constraint.ended:
                    reason = "stop"     # only an end-of-sequence id could follow: the answer is whole
                break
            if cancel is not None and cancel.is_set():
                reason = "cancelled"
                break
    except ColibriError as exc:
        yield ErrorEvent(str(exc))
        return
    finally:
        steps.close()
    tail = ""
    if not hit:  # text held back as a possible stop-string start, or an unfinished byte sequence
        tail, hit = matcher.feed(decoder.flush() if decoder else "")
        tail += "" if hit else matcher.flush()
    end = splitter.feed(tail) + splitter.flush()
    text.append(end.content)
    thought.append(end.reasoning)
    stats = GenerationStats(len(prompt), sampled, t_prefill - t0, t_last - t_first, t_first - t0)
    yield DoneEvent(reason, tuple(tokens), "".join(text), stats, end.content, "".join(thought), end.reasoning)


def request_decoder(tokenizer, request: GenerationRequest) -> StreamDecoder | None:
    """The stream decoder `request` reads its text with (None without a tokenizer): special tokens skipped as it
    asks, the markers of its reasoning format kept."""
    if tokenizer is None:
        return None
    keep = request.reasoning.marker_ids if request.reasoning is not None else frozenset()
    return tokenizer.stream_decoder(skip_special_tokens=request.skip_special_tokens, keep_ids=keep)
