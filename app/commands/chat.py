"""`colibri chat [MODEL]`: an interactive terminal chat with streaming answers.

Multi-turn history goes through the model's chat template; `/reset` forgets it, `/exit` (or
Ctrl-D) leaves, Ctrl-C stops the answer being written and keeps the chat open. A `--session` file is
held by one chat at a time (a second is refused before its model loads); a save that fails, on a full
disk say, is reported in one line and the chat goes on, the file keeping its last good save.
A model that reasons apart (engine.tokenizer.reasoning) shows its reasoning under a "[thinking]" line, dimmed
on a terminal, then its answer under "[answer]"; the history keeps the reasoning for the template.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from app.commands._common import (
    add_model_argument,
    add_sampling_arguments,
    add_speculative_argument,
    context_length,
    load,
    sampling_from_args,
)
from app.commands._memory import add_memory_arguments, load_options
from app.service.loading import KVOptions, kv_pool
from engine.errors import ColibriError

if TYPE_CHECKING:
    from engine.generation.scheduler import DraftTotals

HELP = "commands: /reset forgets the conversation, /exit leaves; Ctrl-C stops an answer"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `chat` command."""
    parser = subparsers.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description="An interactive chat with streaming answers. " + HELP + ". Greedy with a mild "
        "repetition penalty by default: small models answer best that way; raise --temperature for variety.",
    )
    add_model_argument(parser, required=False)
    parser.add_argument("--system", metavar="TEXT", help="a system message for the conversation")
    parser.add_argument("--session", type=Path, metavar="FILE",
                        help="keep the conversation and its KV cache in FILE: resumed from it when it exists, "
                             "saved after every turn (only what is new is appended); one chat at a time")
    add_sampling_arguments(parser, temperature=0.0, repetition_penalty=1.1)
    add_memory_arguments(parser)
    add_speculative_argument(parser)
    parser.set_defaults(func=_run)


class ChatSession:
    """The conversation and one answer at a time; knows nothing of the terminal."""

    def __init__(self, loaded, sampling, max_tokens: int, ctx: int, system: str | None, stop: tuple[str, ...] = (),
                 pool=None, overflow: str = "error", speculative=None):
        if loaded.tokenizer is None or not loaded.tokenizer.has_chat_template:
            raise ColibriError(f"{loaded.name} has no chat template; use `colibri run --prompt` instead")
        from engine.kv import KVCache, KVPool, blocks_for

        self.loaded, self.sampling, self.max_tokens, self.ctx, self.stop = loaded, sampling, max_tokens, ctx, stop
        self.system = system
        # full blocks of every turn stay indexed in the pool: the next turn computes only what is new
        self.pool = pool if pool is not None else KVPool(loaded.spec, blocks_for(ctx) + 1)
        self.overflow = overflow
        self.speculative = speculative      # engine SpeculativeSettings: each answer drafts (None: plainly)
        self.drafting: DraftTotals | None = None    # the drafting counters of every answer so far
        self.cache = KVCache(loaded.spec, ctx, pool=self.pool, overflow=overflow)   # the conversation so far
        self.reused = 0                     # prompt tokens of the last turn taken from the cache
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    # --- saved sessions ---

    def session_file(self, path):
        """The session file at path, bound to this model and these KV settings."""
        from app.atlas.build import model_hash
        from engine.generation.session import KVSettings, SessionFile

        return SessionFile(path, model_hash(self.loaded.path), KVSettings.of(self.cache))

    def save(self, sessions) -> None:
        """Write the conversation and its KV cache (only what is new since the last save)."""
        from engine.generation.session import SessionState

        sessions.save(self.cache, SessionState(sampling=self.sampling, extra={"messages": self.messages}))

    def restore(self, sessions) -> int:
        """Continue a saved conversation: its messages and KV cache; returns the turns restored.

        A torn or damaged last save is left out: `sessions.dropped` says so.
        """
        self.cache.release()
        self.cache, state = sessions.load(self.pool)
        self.messages = list(state.extra.get("messages", []))
        return sum(m["role"] == "user" for m in self.messages)

    def answer(self, text: str, cancel: threading.Event):
        """Add a user turn and stream the answer's events; the answer joins the history when done."""
        from engine.events import DoneEvent
        from engine.generation.generate import GenerationRequest
        from engine.generation.scheduler import Scheduler

        self.messages.append({"role": "user", "content": text})
        tokenizer = self.loaded.tokenizer
        prompt = tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        fmt = tokenizer.reasoning_format
        request = GenerationRequest(prompt=tuple(ids), max_tokens=self.max_tokens, sampling=self.sampling, stop=self.stop,
                                    reasoning=fmt.after(prompt) if fmt is not None else None,
                                    speculative=self.speculative)
        sched = Scheduler(self.loaded.model, self.pool, max_len=self.ctx, tokenizer=self.loaded.tokenizer,
                          stop_ids=self.loaded.stop_ids)
        if self.drafting is not None:
            sched.drafting = self.drafting  # counted across the turns
        seq = sched.submit(request, cancel, self.cache, keep=True)
        self.drafting = sched.drafting
        done = None
        try:
            while True:
                for event in seq.drain():
                    if isinstance(event, DoneEvent):
                        done = event
                    yield event
                if seq.done:
                    break
                sched.step()
                self.reused = seq.reused
        finally:
            if done is not None:
                turn = {"role": "assistant", "content": done.text}
                if done.reasoning:
                    turn["reasoning_content"] = done.reasoning
                self.messages.append(turn)
            else:
                self.messages.pop()  # the turn failed or was abandoned before it ended: forget it


def _run(args: argparse.Namespace) -> int:
    sampling = sampling_from_args(args)
    options = load_options(args)
    lock = None
    if args.session is not None:            # before the model loads: a refused chat costs nothing
        from engine.generation.session import session_lock

        lock = session_lock(args.session)
    try:
        loaded = load(args.model, options=options)
        try:
            return _chat(args, loaded, sampling, KVOptions.of(options))
        finally:
            loaded.close()                  # saves the usage history of a streamed model
    finally:
        if lock is not None:
            lock.release()


class AnswerWriter:
    """Writes an answer as it streams: its reasoning under a "[thinking]" line (dimmed when `color`), then the
    answer under "[answer]"; an answer without reasoning is written as it comes."""

    DIM, RESET = "\x1b[2m", "\x1b[0m"

    def __init__(self, out, color: bool):
        self.out, self.color = out, color
        self.part = ""              # "" (nothing yet), "reasoning" or "answer"

    def write(self, text: str, reasoning: str = "") -> None:
        """Add pieces of the answer and of its reasoning."""
        if reasoning:
            if self.part != "reasoning":
                self.out.write((self.DIM if self.color else "") + "[thinking]\n")
                self.part = "reasoning"
            self.out.write(reasoning)
        if text:
            if self.part == "reasoning":
                self.out.write((self.RESET if self.color else "") + "\n[answer]\n")
            self.part = "answer"
            self.out.write(text)
        self.out.flush()

    def end(self) -> None:
        """The answer is complete: leave the terminal's colours as they were."""
        if self.part == "reasoning" and self.color:
            self.out.write(self.RESET)
        self.out.flush()


def _save(session: ChatSession, sessions) -> None:
    """Save after a turn; a failed save (disk full ...) is one line on stderr, and the chat goes on."""
    from engine.generation.session import SessionSaveError

    try:
        session.save(sessions)
    except SessionSaveError as exc:
        print(f"warning: could not save the session to {exc.path}: {exc.reason} ({exc.written} of {exc.total} "
              "bytes written); the chat goes on, unsaved: free space and the next turn saves again",
              file=sys.stderr)


def _chat(args: argparse.Namespace, loaded, sampling, kv: KVOptions) -> int:
    from engine.events import DoneEvent, ErrorEvent, TokenEvent

    ctx = context_length(loaded, args.ctx)
    from app.service.loading import speculative_settings

    session = ChatSession(loaded, sampling, args.max_tokens, ctx, args.system, tuple(args.stop),
                          pool=kv_pool(loaded.spec, kv, ctx), overflow=kv.overflow,
                          speculative=speculative_settings(loaded, args.speculative, args.draft))
    sessions = session.session_file(args.session) if args.session is not None else None
    if sessions is not None and args.session.exists():
        turns = session.restore(sessions)
        if sessions.dropped is not None:
            print(f"warning: {args.session}: the last turn was damaged and is dropped ({sessions.dropped}); "
                  "the turns before it are kept", file=sys.stderr)
        print(f"(resumed {turns} turn{'s' if turns != 1 else ''} from {args.session})", file=sys.stderr)
    print(f"chatting with {loaded.name}; {HELP}", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print("\n(type /exit or press Ctrl-D to leave)", file=sys.stderr)
            continue
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            return 0
        if text == "/reset":
            session.reset()
            if sessions is not None:
                _save(session, sessions)
            print("(conversation forgotten)", file=sys.stderr)
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]}; {HELP}", file=sys.stderr)
            continue
        cancel = threading.Event()
        # Ctrl-C while answering only raises the flag: the generator sees it before its next
        # forward pass and ends the answer cleanly (an exception inside it would lose the turn)
        previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
        writer = AnswerWriter(sys.stdout, sys.stdout.isatty())
        try:
            for event in session.answer(text, cancel):
                if isinstance(event, TokenEvent):
                    writer.write(event.text, event.reasoning)
                elif isinstance(event, ErrorEvent):
                    writer.end()
                    print(f"\nerror: {event.message}", file=sys.stderr)
                elif isinstance(event, DoneEvent):
                    s = event.stats
                    writer.write(event.tail, event.reasoning_tail)
                    writer.end()
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                    if event.finish_reason == "cancelled":
                        print("[stopped]", file=sys.stderr)
                    else:
                        print(f"[{len(event.tokens)} tokens, {s.decode_tok_s:.1f} tok/s, first token {s.ttft_s:.2f} s]",
                              file=sys.stderr)
        finally:
            signal.signal(signal.SIGINT, previous)
        if sessions is not None:
            _save(session, sessions)         # after every turn: a restart continues from here
