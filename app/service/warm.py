"""Warming up: compile the kernels a model runs before its first question, through the app's own engine path.

Numba compiles each `@njit(cache=True)` kernel at its first call with new argument types and keeps the
machine code in its cache (NUMBA_CACHE_DIR, else __pycache__ beside the modules). With an empty cache the
first answer waited for those compiles (153 s to SmolLM2's first token here, against 4 s warm). `warm_up`
loads the model as the app does (EngineService, so the scheduler's batched forward and the fused step when
the model takes it) and answers two short chat questions, greedy and sampled at the chat window's defaults,
so every kernel of a prompt chunk, a decode step and the sampler is compiled into the cache. The app runs it in a
child process (`warm_up_apart`), so that the compiler's memory is not kept in the app's.

It runs the model itself rather than a tiny random one: the kernels' signatures follow the real tensors
(GGUF block types or the container's widths and layouts, read-only memory maps), which a model made of fresh
arrays would not share. Only a few tokens are generated, so a warm cache makes it take seconds.

Measured on the 2-core machine (2026-12-05, load 3 to 4), `colibri run` with 8 tokens, wall time:
SmolLM2's Q4_1 GGUF 174 s cold, 4.2 s after a 256 s warm-up; the demo model 111 s cold, 2.6 s after
a 104 s warm-up. A warm-up on a warm cache takes 3.6 s (the demo model) to 6.4 s (the GGUF).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from app.hub.progress import HubEvent, Note, Progress, Report
from app.service.messages import Generation, LoadOptions
from engine.errors import ColibriError
from engine.events import DoneEvent, ErrorEvent
from engine.generation.sampling import SamplingParams

# The chat window's defaults (ui.chat.ChatDefaults), so the sampled path compiles what a first answer runs.
SAMPLED = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=0)
GREEDY = SamplingParams()
QUESTION = "In two sentences, why do hummingbirds hover in front of flowers while they feed?"
ANSWER_TOKENS = 4          # decode steps per pass: the first compiles, the rest show the cache is used


def _quiet(event) -> None:
    pass


def _answer(service, info, sampling: SamplingParams, question: str, timeout: float,
            tick: Callable[[], None] = lambda: None) -> None:
    """One generation to its end, calling `tick` each second while it runs (a compile can take minutes: the
    caller shows the time and may raise to stop); raises ColibriError with the engine's message if it fails."""
    done = threading.Event()
    errors: list[str] = []

    def listen(event) -> None:
        if isinstance(event, Generation):
            if isinstance(event.event, ErrorEvent):
                errors.append(event.event.message)
            if isinstance(event.event, (DoneEvent, ErrorEvent)):
                done.set()

    if info.chat:
        service.generate(messages=[{"role": "user", "content": question}], sampling=sampling,
                         max_tokens=ANSWER_TOKENS, listener=listen)
    else:                   # no chat template: a prompt of token ids from the question's bytes
        ids = [b % info.vocab_size for b in question.encode()]
        service.generate(ids, sampling=sampling, max_tokens=ANSWER_TOKENS, listener=listen)
    end = time.monotonic() + timeout
    while not done.wait(1.0):
        if time.monotonic() > end:
            raise ColibriError(f"the warm-up's answer took longer than {timeout:.0f} s")
        tick()
    if errors:
        raise ColibriError(f"the warm-up's answer failed: {errors[0]}")


# the warm-up's questions are not the user's: they must not teach a streamed model's cache which experts to pin
QUIET_LOAD = LoadOptions(history=False)


def warm_up(model: str | Path, report: Report = _quiet, options: LoadOptions = QUIET_LOAD,
            timeout: float = 3600.0) -> float:
    """Load MODEL (a folder, container, GGUF or pulled name) and answer a greedy and a sampled question, so its
    kernels are compiled into Numba's cache; returns the seconds taken. `report` gets a Progress per step, and each
    second of a step with the time so far, and may raise to stop there (the GUI's Cancel)."""
    from app.service.local import EngineService

    t0 = time.perf_counter()
    steps = ("loading the model", "a greedy answer (its kernels compile at their first use)",
             "a sampled answer (its kernels compile at their first use)")

    def step(i: int) -> None:
        report(Progress("warm", i, len(steps), f"warm-up: {steps[i]} ({time.perf_counter() - t0:.0f} s so far)"))

    with EngineService(name="colibri-warm") as service:
        step(0)
        info = service.load_and_wait(model, options, timeout)
        for i, (sampling, question) in enumerate(((GREEDY, QUESTION), (SAMPLED, QUESTION.upper())), start=1):
            step(i)     # a different prompt each time: the second must not reuse the first's cached prefix
            _answer(service, info, sampling, question, timeout, lambda i=i: step(i))
    seconds = time.perf_counter() - t0
    report(Note(f"warm-up: kernels ready in {seconds:.1f} s"))
    return seconds


ERROR = "colibri: error: "      # how the command line says what went wrong: the reason the child gives


def event_line(event: HubEvent) -> str:
    """EVENT as the JSON line `colibri warm --events` prints (read back by `read_event`)."""
    return json.dumps({"kind": type(event).__name__, **asdict(event)})


def read_event(line: str) -> HubEvent | None:
    """The event of a line of `colibri warm --events`; None for any other line (a library printing on stdout)."""
    try:
        data = json.loads(line)
        kind = data.pop("kind")
        return Note(**data) if kind == "Note" else Progress(**data) if kind == "Progress" else None
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def warm_up_apart(model: str | Path, report: Report = _quiet, command: list[str] | None = None,
                  models_dir: Path | None = None) -> float:
    """`colibri warm --events MODEL` (or `command`) in a child process: MODEL pulled or prepared into `models_dir`
    when it is a name not here yet, then warmed up; its events handed to `report`, which may raise to stop it (the
    child and the processes it started, the stand-in, are killed). Numba's compiler keeps the memory of a compile
    (hundreds of MB for a model's kernels, and the upcycling's calibration compiles too): in a child it goes back to
    the system when the child exits, instead of staying in the app's resident memory, under the model's budget, for
    as long as the app runs. Returns the seconds taken; ColibriError with the error the child gave (else its last
    lines) when it fails."""
    from app.config.runtime import colibri_command

    t0 = time.perf_counter()
    where = ["--models-dir", str(models_dir)] if models_dir is not None else []
    argv = command if command is not None else colibri_command("warm", "--events", *where, str(model))
    tail: deque[str] = deque(maxlen=5)
    with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, errors="replace", start_new_session=True) as child:
        drain = threading.Thread(target=lambda: tail.extend(line.rstrip() for line in child.stderr), daemon=True)
        drain.start()       # stderr read meanwhile: a child that logs much must never block on a full pipe
        try:
            for line in child.stdout:
                event = read_event(line)
                if event is not None:
                    report(event)
        except BaseException:
            _kill_group(child)
            raise
        code = child.wait()
        drain.join(5.0)
    if code != 0:
        errors = [line.removeprefix(ERROR) for line in tail if line.startswith(ERROR)]
        said = errors[-1] if errors else "; ".join(line for line in tail if line) or f"exit status {code}"
        raise ColibriError(f"preparing {model} stopped: {said}")
    return time.perf_counter() - t0


def _kill_group(child: subprocess.Popen) -> None:
    """Kill the child and what it started (its own session: the stand-in it may be waiting for goes too)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError):     # gone already, or no process groups here
        child.kill()
