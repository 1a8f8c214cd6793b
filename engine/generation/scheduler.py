"""Batching: several sequences decode together, one forward pass per step.

Each step, every decoding sequence contributes its next token and at most one prefilling sequence
contributes a chunk of its prompt, so a long prompt never stalls the others for more than a chunk.
The model runs all rows at once (each distinct expert of a layer read once for the whole batch);
attention runs per sequence on its own cache. Rows are computed as they would be alone, so every
sequence's tokens equal those of running it by itself.

New requests join between steps (`submit`); a finished or cancelled sequence leaves and gives its
blocks back (full blocks stay cached in the pool's prefix index for the next request that shares them);
a request cancelled while it still waits for room leaves the queue at the next step.
A request starts from the longest prefix of its prompt already in the pool.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from engine.errors import ColibriError, GenerationError
from engine.events import DoneEvent, ErrorEvent, Event, GenerationStats, ProgressEvent, TokenEvent
from engine.generation.generate import GenerationRequest, Seen, StopStrings, request_decoder
from engine.generation.grammar import make_constraint
from engine.generation.prefill import PREFILL_CHUNK
from engine.generation.sampling import (
    History,
    apply_processors,
    make_logits_processors,
    make_sampler,
    token_logprobs,
)
from engine.kv import KVCache, KVPool
from engine.models.transformer import Transformer
from engine.tokenizer.reasoning import open_parser


@dataclass(eq=False)
class Sequence:
    """One request inside the scheduler: its cache, sampler and the text produced so far."""

    id: int
    request: GenerationRequest
    cache: KVCache
    cancel: threading.Event | None
    stop_ids: frozenset[int]
    events: deque = field(default_factory=deque)
    done: bool = False
    keep: bool = False         # the caller owns the cache: it is not released at the end
    reused: int = 0            # prompt tokens taken from the prefix cache
    prefilled: int = 0         # prompt tokens in the cache
    pending: int | None = None  # the sampled token the next step feeds
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    thought: list[str] = field(default_factory=list)   # the reasoning, when the request splits it off
    sampled: int = 0
    t0: float = 0.0
    t_prefill: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0

    def drain(self) -> Iterator[Event]:
        """The events produced since the last call."""
        while self.events:
            yield self.events.popleft()


class Scheduler:
    """Runs the submitted requests of one model together, step by step (single-threaded: the
    caller's engine thread calls `submit` and `step`)."""

    def __init__(self, model: Transformer, pool: KVPool, *, max_len: int, tokenizer=None,
                 stop_ids: frozenset[int] = frozenset(), max_batch: int = 8, prefill_chunk: int = PREFILL_CHUNK,
                 overflow: str = "error"):
        self.model, self.pool, self.max_len, self.tokenizer = model, pool, max_len, tokenizer
        self.stop_ids, self.max_batch, self.prefill_chunk, self.overflow = stop_ids, max_batch, prefill_chunk, overflow
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = 0
        self.steps = 0
        self.batch_rows = 0

    # --- requests ---

    def submit(self, request: GenerationRequest, cancel: threading.Event | None = None,
               cache: KVCache | None = None, keep: bool = False) -> Sequence:
        """Queue a request; it joins the batch at the next step with room. `cache` (on this
        scheduler's pool) carries a sequence's own retention settings or earlier turns; with `keep`
        it still holds the prompt and answer afterwards (a chat's next turn, a saved session)."""
        self._ids += 1
        if cache is None:
            cache = KVCache(self.model.spec, self.max_len, pool=self.pool, overflow=self.overflow)
        elif cache.pool is not self.pool:
            raise GenerationError("the cache belongs to another KV pool than the scheduler's")
        stops = request.stop_ids if request.stop_ids is not None else self.stop_ids
        seq = Sequence(self._ids, request, cache, cancel, stops, keep=keep, t0=time.perf_counter())
        try:
            request.sampling.validate()
            if request.max_tokens < 1:
                raise GenerationError(f"max_tokens is {request.max_tokens}; it must be at least 1")
            if not request.prompt:
                raise GenerationError("no tokens to run: the prompt is empty")
            if request.logprobs is not None and request.logprobs < 0:
                raise GenerationError(f"logprobs asks for {request.logprobs} alternatives; give 0 or more")
            if len(request.prompt) >= cache.max_len and cache.overflow == "error":
                raise GenerationError(f"the prompt has {len(request.prompt)} tokens but the context holds "
                                      f"{cache.max_len}; shorten the prompt, raise --ctx or use --overflow")
        except ColibriError as exc:
            self._fail(seq, str(exc))
            return seq
        seq.sampler = make_sampler(request.sampling)
        seq.processors = make_logits_processors(request.sampling)
        seq.constraint = None
        if request.grammar is not None:
            try:    # its own matcher: each sequence of the batch follows its own grammar
                seq.constraint = make_constraint(request.grammar, self.tokenizer, self.model.spec.vocab_size, stops,
                                                 request.max_tokens)
            except ColibriError as exc:
                self._fail(seq, str(exc))
                return seq
            seq.processors.append(seq.constraint)
        seq.seen = Seen(request.prompt)     # prompt then sampled ids: what the processors read
        seq.decoder = request_decoder(self.tokenizer, request)
        seq.matcher = StopStrings(request.stop)
        seq.splitter = open_parser(request.reasoning)
        self.waiting.append(seq)
        return seq

    @property
    def busy(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    # --- steps ---

    def step(self) -> list[Sequence]:
        """One forward pass over the batch; returns the sequences that produced events."""
        touched: list[Sequence] = []
        for seq in [s for s in self.waiting if s.cancel is not None and s.cancel.is_set()]:
            self.waiting.remove(seq)     # a cancelled request leaves the queue now, not when the batch has room
            self._finish(seq, "cancelled")
            touched.append(seq)
        self._admit()
        for seq in list(self.running):
            if seq.cancel is not None and seq.cancel.is_set():
                self._finish(seq, "cancelled")
                touched.append(seq)
        items: list[tuple[Sequence, list[int]]] = []
        prefilling = False
        for seq in self.running:
            if seq.pending is not None:
                items.append((seq, [seq.pending]))
            elif not prefilling:             # one prompt chunk per step: decoding never waits long
                prefilling = True
                start = seq.prefilled
                items.append((seq, list(seq.request.prompt[start : start + self.prefill_chunk])))
        if not items:
            return touched
        results = self._forward(items)
        self.steps += 1
        self.batch_rows += sum(len(ids) for _, ids in items)
        for (seq, ids), logits in zip(items, results):
            touched.append(seq)
            if isinstance(logits, str):
                self._fail(seq, logits)
                continue
            if seq.pending is None:
                seq.prefilled += len(ids)
                total = len(seq.request.prompt)
                seq.events.append(ProgressEvent(seq.prefilled, total))
                if seq.prefilled < total:
                    continue
                seq.t_prefill = time.perf_counter()
            self._sample(seq, logits[-1])
        return touched

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while self.busy:
            self.step()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting.popleft()
            prompt = seq.request.prompt
            seq.reused = seq.prefilled = seq.cache.adopt(prompt)
            self.running.append(seq)

    def _forward(self, items) -> list:
        """Logits per item, or an error message for the items that failed (the others still run)."""
        try:
            return self.model.forward_batch([(ids, seq.cache) for seq, ids in items])
        except ColibriError as exc:
            if len(items) == 1:
                return [str(exc)]
        out = []
        for item in items:                    # find the one that failed; the rest go on
            try:
                out.append(self.model.forward_batch([(item[1], item[0].cache)])[0])
            except ColibriError as exc:
                out.append(str(exc))
        return out

    def _sample(self, seq: Sequence, logits: np.ndarray) -> None:
        req = seq.request
        raw = logits                          # [V] the model's own: what log-probabilities describe
        if seq.processors:
            logits = apply_processors(logits, History(seq.seen.view(), seq.seen.n_prompt), seq.processors)
        try:
            token = seq.sampler(logits)
            if seq.constraint is not None:
                seq.constraint.advance(token)
            scored = token_logprobs(raw, token, req.logprobs) if req.logprobs is not None else None
        except ColibriError as exc:
            self._fail(seq, str(exc))
            return
        seq.seen.append(token)
        now = time.perf_counter()
        if seq.sampled == 0:
            seq.t_first = now
        seq.t_last = now
        seq.sampled += 1
        if token in seq.stop_ids:
            self._finish(seq, "stop")
            return
        seq.tokens.append(token)
        delta, hit = seq.matcher.feed(seq.decoder.push(token) if seq.decoder else "")
        part = seq.splitter.feed(delta)
        seq.text.append(part.content)
        seq.thought.append(part.reasoning)
        lp, alts = scored if scored is not None else (None, ())
        seq.events.append(TokenEvent(len(seq.tokens) - 1, token, part.content, part.reasoning, lp, alts))
        if hit:
            self._finish(seq, "stop", hit=True)
        elif len(seq.tokens) >= req.max_tokens or (seq.cache.overflow == "error" and seq.cache.length + 1 >= seq.cache.max_len):
            self._finish(seq, "length")
        else:
            seq.pending = token

    def _finish(self, seq: Sequence, reason: str, hit: bool = False) -> None:
        tail = ""
        if not hit:
            tail, hit = seq.matcher.feed(seq.decoder.flush() if seq.decoder else "")
            tail += "" if hit else seq.matcher.flush()
        last = seq.splitter.feed(tail) + seq.splitter.flush()
        seq.text.append(last.content)
        seq.thought.append(last.reasoning)
        end = seq.t_prefill or time.perf_counter()
        stats = GenerationStats(len(seq.request.prompt), seq.sampled, end - seq.t0, seq.t_last - seq.t_first,
                                (seq.t_first or end) - seq.t0)
        seq.events.append(DoneEvent(reason, tuple(seq.tokens), "".join(seq.text), stats, last.content,
                                    "".join(seq.thought), last.reasoning))
        self._leave(seq)

    def abort(self, message: str) -> list[Sequence]:
        """End every waiting and running request with an ErrorEvent (a fault of the engine, not of one
        request); their blocks go back to the pool. Returns the sequences ended."""
        ended = [*self.running, *self.waiting]
        self.waiting.clear()
        for seq in ended:
            self._fail(seq, message)
        return ended

    def _fail(self, seq: Sequence, message: str) -> None:
        seq.events.append(ErrorEvent(message))
        self._leave(seq)

    def _leave(self, seq: Sequence) -> None:
        seq.done = True
        seq.pending = None
        if not seq.keep:
            seq.cache.release()
        if seq in self.running:
            self.running.remove(seq)
