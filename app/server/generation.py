"""What every generating route shares, whichever API it speaks (OpenAI's, Anthropic's, Ollama's): the answer's
token budget (`budget`), starting a generation on the served engine (`start`: the queue's 429, a closing server's
503, cancellation as soon as the client leaves), the answer's events up to its end (`events`), and which stop
string ended an answer (`stop_sequence`). The routes only translate requests in and events out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import Request

from app.server.engine import QueueFull, Served, Ticket
from app.server.errors import ApiError
from engine.errors import ColibriError
from engine.events import DoneEvent, ErrorEvent, TokenEvent
from engine.generation.grammar import Grammar
from engine.generation.sampling import SamplingParams
from engine.tokenizer.reasoning import ReasoningFormat

RETRY_AFTER = 2             # seconds a client is told to wait when the queue is full


@dataclass(frozen=True)
class Budget:
    """How many tokens an answer may take."""

    max_tokens: int         # the limit the engine applies
    clamped: bool           # the limit asked for did not fit in the context and was cut to what fits


def budget(asked: int | None, n_prompt: int, ctx: int, param: str) -> Budget:
    """The answer's budget: what was asked, clamped to the room the prompt leaves in the context (every API
    clamps alike: an answer that reaches the end of the context ends as if it had reached max_tokens, and the
    Anthropic route says `model_context_window_exceeded`). A prompt that leaves no room is refused (400, naming
    `param`, with the numbers); no limit asked means the whole room."""
    if n_prompt < 1:
        raise ApiError(400, "the prompt is empty", param)
    room = ctx - n_prompt
    if room < 1:
        raise ApiError(400, f"the prompt has {n_prompt} tokens but the context holds {ctx}; shorten it",
                       param, "context_length_exceeded")
    if asked is None:
        return Budget(room, False)
    return Budget(min(asked, room), asked > room)


def start(engine: Served, prompt: Sequence[int], request: Request, *, max_tokens: int, sampling: SamplingParams,
          stops: tuple[str, ...] = (), reasoning: ReasoningFormat | None = None, grammar: Grammar | None = None,
          logprobs: int | None = None, speculative: bool | None = None) -> Ticket:
    """Submit a generation (`logprobs`: that many alternatives' log-probabilities on each token event, None for
    none): 429 with Retry-After when the queue is full, 503 when the server is closing; the ticket is cancelled as
    soon as the client disconnects, whether it still waits or runs. `speculative` turns drafting on or off for this
    answer (None: as the server was started)."""
    try:
        ticket = engine.submit(list(prompt), max_tokens=max_tokens, sampling=sampling, stop=stops,
                               loop=asyncio.get_running_loop(), reasoning=reasoning, logprobs=logprobs,
                               grammar=grammar, speculative=speculative)
    except QueueFull as exc:
        raise ApiError(429, str(exc), kind="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER)}) from None
    except ColibriError as exc:
        raise ApiError(503, str(exc), kind="server_error") from None
    ticket.watch(request.receive)
    return ticket


async def events(ticket: Ticket) -> AsyncIterator[TokenEvent | DoneEvent | ErrorEvent]:
    """The ticket's token events, then its DoneEvent or ErrorEvent (the last); the generation is stopped and its
    KV blocks freed when the caller stops reading, whether it finished or was abandoned."""
    try:
        while True:
            event = await ticket.events.get()
            if isinstance(event, (TokenEvent, DoneEvent, ErrorEvent)):
                yield event
            if isinstance(event, (DoneEvent, ErrorEvent)):
                return
    finally:
        ticket.close()


def stop_sequence(decoded: str, stops: Sequence[str]) -> str | None:
    """The stop string that ended an answer whose generated tokens decode to `decoded` (`finish_reason` "stop"),
    or None when an end-of-sequence token ended it: the one found first (the engine cuts at the first that
    completes; of two found at one place, the shorter completed first)."""
    found = [(i, len(s), s) for s in stops if s and (i := decoded.find(s)) >= 0]
    return min(found)[2] if found else None
