"""Batching: several sequences decode together, one forward pass per step.

Each step, every decoding sequence contributes its next token and the prefilling sequences, in the order they
arrived, contribute chunks of their prompts up to `prefill_chunk` tokens in all, so a long prompt never stalls the
others for more than a chunk, and short prompts waiting together run in one pass (each weight read once for all).
The model runs all rows at once (each distinct expert of a layer read once for the whole batch);
attention runs per sequence on its own cache. Rows are computed as they would be alone, so every
sequence's tokens equal those of running it by itself.

New requests join between steps (`submit`), up to `max_batch` running at once (fewer for a streamed model whose
expert cache holds the steps of fewer: `Scheduler.room`); a finished or cancelled sequence leaves and gives its
blocks back (full blocks stay cached in the pool's prefix index for the next request that shares them);
a request cancelled while it still waits for room leaves the queue at the next step.
A request starts from the longest prefix of its prompt already in the pool.

A request with `speculative` settings drafts (engine.generation.speculative): each step its sequence feeds
[pending token] + the draft its own drafter proposes, in the same pass as the others' rows, and its tokens are
chosen row by row from those logits exactly as plain decoding would choose them (same processors and grammar,
one sampler call per token, in order), up to the first that differs from the draft; the cache then drops the
rejected rows. Its own `SpeculationController` switches drafting off when it loses and tries again later.
A step that also prefills prompt chunks runs the chunks in a pass of their own, so that the drafting rows' logits
are computed without the chunks' [T, V].
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from engine.errors import ColibriError, GenerationError
from engine.events import DoneEvent, ErrorEvent, Event, GenerationStats, ProgressEvent, TokenEvent
from engine.generation.generate import (
    GenerationRequest,
    Seen,
    StopStrings,
    close_drafters,
    draft_room,
    request_decoder,
)
from engine.generation.grammar import make_constraint
from engine.generation.prefill import PREFILL_CHUNK
from engine.generation.sampling import (
    History,
    apply_processors,
    make_logits_processors,
    make_sampler,
    token_logprobs,
)
from engine.generation.speculative import HiddenStateDrafter, SpeculationController, make_drafter
from engine.kv import KVCache, KVFullError, KVPool
from engine.models.transformer import Transformer
from engine.tokenizer.reasoning import open_parser


@dataclass
class DraftTotals:
    """Drafting counters of the sequences that have left the scheduler (what reports and tests read)."""

    sequences: int = 0      # speculative sequences finished
    draft_steps: int = 0    # steps that verified a draft
    drafted: int = 0        # draft tokens proposed
    accepted: int = 0       # draft tokens accepted
    produced: int = 0       # tokens the speculative sequences' decode steps produced
    switches: int = 0       # times a controller switched drafting off

    def add(self, c: SpeculationController) -> None:
        """Count one finished sequence's controller."""
        self.sequences += 1
        self.draft_steps += c.draft_steps
        self.drafted += c.drafted
        self.accepted += c.accepted
        self.produced += c.produced
        self.switches += c.switches


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
    drafter: object | None = None                     # a Drafter when the request is speculative
    speculation: SpeculationController | None = None  # its drafting counters and on/off verdicts

    def drain(self) -> Iterator[Event]:
        """The events produced since the last call."""
        while self.events:
            yield self.events.popleft()


class Scheduler:
    """Runs the submitted requests of one model together, step by step (single-threaded: the
    caller's engine thread calls `submit` and `step`)."""

    def __init__(self, model: Transformer, pool: KVPool, *, max_len: int, tokenizer=None,
                 stop_ids: frozenset[int] = frozenset(), max_batch: int = 8, prefill_chunk: int = PREFILL_CHUNK,
                 overflow: str = "error", clock: Callable[[], float] = time.perf_counter):
        self.model, self.pool, self.max_len, self.tokenizer = model, pool, max_len, tokenizer
        self.stop_ids, self.max_batch, self.prefill_chunk, self.overflow = stop_ids, max_batch, prefill_chunk, overflow
        self.clock = clock      # times the steps the drafting controllers judge (tests pass a steady one)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = 0
        self.steps = 0
        self.batch_rows = 0
        # steps that only decoded (one token a row: no prompt, no draft) and their rows and seconds, by which a
        # batch's decode is judged apart from its prompts (which batching does not make cheaper)
        self.decode_steps = 0
        self.decode_rows = 0
        self.decode_seconds = 0.0
        self.drafting = DraftTotals()

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
        if request.speculative is not None:
            try:
                seq.drafter = make_drafter(request.speculative, self.model.spec.vocab_size, cache.max_len)
            except ColibriError as exc:
                self._fail(seq, str(exc))
                return seq
            seq.speculation = SpeculationController(request.speculative)
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
        t0 = self.clock()
        items: list[tuple[Sequence, list[int]]] = []
        drafts: dict[int, list[int]] = {}    # Sequence.id -> the draft its item verifies
        chunks: list[tuple[Sequence, list[int]]] = []
        room = self.prefill_chunk           # prompt tokens per step, all prefilling sequences together
        for seq in self.running:
            if seq.pending is not None:
                draft = self._propose(seq)
                if draft:
                    drafts[seq.id] = draft
                items.append((seq, [seq.pending, *draft]))
            elif room > 0:                  # a chunk's worth of prompts per step: decoding never waits long
                start = seq.prefilled
                chunks.append((seq, list(seq.request.prompt[start : start + room])))
                room -= len(chunks[-1][1])
        decoding = bool(items) and not chunks and not drafts
        if chunks and not any(seq.speculation is not None for seq, _ in items):
            items += chunks
            chunks = []
        if not items and not chunks:
            return touched
        # an MTP drafter reads every verified position's hidden states while its drafting is on
        mtp = any(isinstance(s.drafter, HiddenStateDrafter) and s.speculation is not None and s.speculation.on
                  for s, _ in items)
        watch: list[np.ndarray] | None = [] if mtp else None
        results = self._forward(items, bool(drafts), watch) if items else []
        seconds = self.clock() - t0      # what the controllers time: the decode rows' step
        if decoding:
            self.decode_steps += 1
            self.decode_rows += len(items)
            self.decode_seconds += seconds
        if chunks:   # apart from the speculative rows: their logits are not all computed, nor timed with them
            items += chunks
            results += self._forward(chunks, False, None)
        self.steps += 1
        self.batch_rows += sum(len(ids) for _, ids in items)
        offsets = np.cumsum([0] + [len(ids) for _, ids in items])
        for (seq, ids), logits, at in zip(items, results, offsets):
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
            elif seq.speculation is None:
                self._sample(seq, logits[-1])
            else:
                hidden = watch[0][at : at + len(ids)] if watch else None    # [1 + k, hidden]
                self._verify(seq, logits, drafts.get(seq.id, []), hidden, seconds)
        return touched

    def _propose(self, seq: Sequence) -> list[int]:
        """The draft a speculative sequence verifies this step ([] for a plain step)."""
        c = seq.speculation
        if c is None or seq.drafter is None or not c.want_draft():
            return []
        spec = seq.request.speculative
        assert spec is not None         # a controller is made from it
        k = draft_room(seq.cache, spec.max_draft, len(seq.tokens), seq.request.max_tokens)
        if k < 1:
            return []
        vocab = self.model.spec.vocab_size
        draft = list(seq.drafter.propose(seq.seen.view(), k))[:k]    # type: ignore[attr-defined]
        for i, t in enumerate(draft):    # a draft model's vocabulary may be larger: its guess ends there
            if not 0 <= t < vocab:
                return draft[:i]
        return draft

    def _verify(self, seq: Sequence, rows: np.ndarray, draft: list[int], hidden: np.ndarray | None,
                seconds: float) -> None:
        """Choose a speculative sequence's tokens from its rows [1 + k, V] as plain decoding would, up to the first
        that leaves the draft or ends the sequence; the cache keeps the rows of the tokens consumed."""
        c = seq.speculation
        assert c is not None
        if len(rows) != 1 + len(draft):
            draft = []                  # the pool had no room for the draft: the step ran the pending token alone
        base = seq.cache.length - 1 - len(draft)      # where the pending token sits
        seq.speculation = None          # held back while the tokens go out: a sequence they end is counted below
        used = 0
        for j in range(len(draft) + 1):
            token = self._sample(seq, rows[j], held=base + 1 + j)
            used = j + 1
            if seq.done or j == len(draft) or token != draft[j]:
                break
        if draft and not (seq.done and not seq.keep):
            seq.cache.truncate(base + used)     # plain decoding holds the pending token and the accepted drafts
        if hidden is not None and not seq.done and isinstance(seq.drafter, HiddenStateDrafter):
            seq.drafter.observe(base, hidden[:used])     # the verified positions' hidden states [used, hidden]
        c.record(len(draft), max(used - 1, 0), used, seconds)
        if seq.done:
            self.drafting.add(c)
        else:
            seq.speculation = c

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while self.busy:
            self.step()

    @property
    def room(self) -> int:
        """How many sequences run at once: max_batch, or fewer for a model whose streamed experts the cache holds
        for fewer (their steps would read over each other's experts: `StreamingExpertSource.batch_rows`)."""
        if self.model.reads_ahead and self.max_batch > 1:        # (a StreamingExpertSource)
            return self.model.experts.batch_rows(self.max_batch)
        return self.max_batch

    def _admit(self) -> None:
        if not self.waiting:
            return
        room = self.room                      # (the store's arithmetic: only when someone waits)
        while self.waiting and len(self.running) < room:
            seq = self.waiting.popleft()
            prompt = seq.request.prompt
            seq.reused = seq.prefilled = seq.cache.adopt(prompt)
            self.running.append(seq)

    def _forward(self, items, all_logits: bool = False, hidden: list[np.ndarray] | None = None) -> list:
        """Logits per item, or an error message for the items that failed (the others still run). With
        `all_logits`, every row's logits (the drafts'); `hidden` receives the last layer's output of all rows."""
        try:
            return self.model.forward_batch([(ids, seq.cache) for seq, ids in items], all_logits=all_logits,
                                            hidden=hidden)
        except ColibriError as exc:
            if len(items) == 1 and not (isinstance(exc, KVFullError) and len(items[0][1]) > 1):
                return [str(exc)]
        if hidden is not None:
            hidden.clear()      # the rows below run one item at a time: no batch-wide hidden states
        out: list[np.ndarray | str] = []
        for seq, ids in items:                # find the one that failed; the rest go on
            base = seq.cache.length
            try:
                out.append(self.model.forward_batch([(ids, seq.cache)], all_logits=all_logits)[0])
            except KVFullError as exc:
                if seq.pending is None or len(ids) == 1:
                    out.append(str(exc))
                    continue
                seq.cache.truncate(base)     # a pool short of blocks for the draft: this step decodes plainly
                try:
                    out.append(self.model.forward_batch([(ids[:1], seq.cache)])[0])
                except ColibriError as exc2:
                    out.append(str(exc2))
            except ColibriError as exc:
                out.append(str(exc))
        return out

    def _sample(self, seq: Sequence, logits: np.ndarray, held: int | None = None) -> int | None:
        """Choose the sequence's next token from `logits` [V] and emit it; `held` is the cache length plain decoding
        would have here (the cache's own when None). Returns the token, or None when choosing failed."""
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
            return None
        seq.seen.append(token)
        now = time.perf_counter()
        if seq.sampled == 0:
            seq.t_first = now
        seq.t_last = now
        seq.sampled += 1
        if token in seq.stop_ids:
            self._finish(seq, "stop")
            return token
        seq.tokens.append(token)
        delta, hit = seq.matcher.feed(seq.decoder.push(token) if seq.decoder else "")
        part = seq.splitter.feed(delta)
        seq.text.append(part.content)
        seq.thought.append(part.reasoning)
        lp, alts = scored if scored is not None else (None, ())
        seq.events.append(TokenEvent(len(seq.tokens) - 1, token, part.content, part.reasoning, lp, alts))
        if hit:
            self._finish(seq, "stop", hit=True)
        elif len(seq.tokens) >= req.max_tokens or (seq.cache.overflow == "error"
                                                   and (held if held is not None else seq.cache.length) + 1
                                                   >= seq.cache.max_len):
            # a grammar that lets only an end-of-sequence id follow: the answer is whole, cut just before its end
            ended = seq.constraint is not None and seq.constraint.ended
            self._finish(seq, "stop" if ended else "length")
        else:
            seq.pending = token
        return token

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
        if seq.speculation is not None:
            self.drafting.add(seq.speculation)
        spec = seq.request.speculative
        if seq.drafter is not None and spec is not None and spec.drafter is None:   # made here, not the caller's
            close_drafters(seq.drafter)
        seq.drafter = None
        if not seq.keep:
            seq.cache.release()
        if seq in self.running:
            self.running.remove(seq)
