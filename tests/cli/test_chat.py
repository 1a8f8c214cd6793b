"""`colibri chat` on the real SmolLM2: multi-turn history, /reset, /exit, Ctrl-C stopping an answer."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from app.commands.chat import ChatSession
from engine.events import DoneEvent, TokenEvent
from engine.generation.sampling import SamplingParams
from engine.loader import load_model


@pytest.fixture(scope="module")
def session(smollm2_gguf):
    loaded = load_model(smollm2_gguf)
    return ChatSession(loaded, SamplingParams(repetition_penalty=1.1), max_tokens=40, ctx=2048, system=None)


def _answer(session, text):
    events = list(session.answer(text, threading.Event()))
    return "".join(e.text for e in events if isinstance(e, TokenEvent)) + events[-1].tail, events[-1]


@pytest.mark.slow
def test_turns_build_a_history_and_reset_forgets_it(session):
    session.reset()
    first, done = _answer(session, "What is the capital of France?")
    assert "Paris" in first and isinstance(done, DoneEvent)
    second, _ = _answer(session, "And of Germany?")  # only answerable with the first turn in context
    assert "Berlin" in second
    assert session.reused >= 16                     # the first turn's blocks were reused, not recomputed
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
    assert session.messages[1]["content"] == first
    session.reset()
    assert session.messages == []


@pytest.mark.slow
def test_piped_chat_answers_and_exits(smollm2_gguf):
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "chat", str(smollm2_gguf), "--max-tokens", "30"],
        input="What is the capital of France?\n/reset\n/nope\n/exit\n", capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "conversation forgotten" in proc.stderr and "unknown command /nope" in proc.stderr


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_and_keeps_the_chat(smollm2_gguf):
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "chat", str(smollm2_gguf), "--max-tokens", "2000", "--ctx", "4096"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
    )
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda f=f, into=into: into.extend(iter(lambda: f.read(1), "")), daemon=True)
               for f, into in ((proc.stdout, out), (proc.stderr, err))]
    for reader in readers:
        reader.start()
    proc.stdin.write("Write a very long essay about the history of Rome, with many chapters.\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 120
    while len("".join(out)) < 40 and time.monotonic() < deadline:  # the answer is streaming
        time.sleep(0.05)
    assert len("".join(out)) >= 40, "no answer streamed"
    proc.send_signal(signal.SIGINT)

    def stopped() -> bool:  # the answer ended as stopped and the chat asks for the next line
        return "[stopped]" in "".join(err) and "".join(out).endswith("> ")

    deadline = time.monotonic() + 60
    while not stopped() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stopped(), "the answer did not stop"
    at_stop = "".join(out)
    proc.stdin.write("/exit\n")
    proc.stdin.flush()
    assert proc.wait(timeout=60) == 0  # the chat was still there to take /exit
    for reader in readers:
        reader.join(timeout=10)
    assert "".join(out) == at_stop  # nothing more is written once stopped


def _chat(model, session, lines: str):
    proc = subprocess.run([sys.executable, "-m", "app.cli", "chat", str(model), "--max-tokens", "24", "--session",
                           str(session)], input=lines, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.slow
def test_a_saved_session_resumes_byte_identically(smollm2_gguf, tmp_path):
    turns = "My name is Ada and I keep bees.\n", "What do I keep, and what is my name?\n"
    whole = _chat(smollm2_gguf, tmp_path / "one.session", turns[0] + turns[1] + "/exit\n")
    first = _chat(smollm2_gguf, tmp_path / "two.session", turns[0] + "/exit\n")
    size = (tmp_path / "two.session").stat().st_size
    again = _chat(smollm2_gguf, tmp_path / "two.session", turns[1] + "/exit\n")      # a new process
    assert "(resumed 1 turn from" in again.stderr
    answers = lambda out: out.replace("> ", "")  # noqa: E731 - the input prompts differ, not the answers
    assert answers(first.stdout + again.stdout) == answers(whole.stdout)           # the same bytes
    assert (tmp_path / "two.session").stat().st_size > size
    other = tmp_path / "other.session"
    (tmp_path / "two.session").rename(other)
    proc = subprocess.run([sys.executable, "-m", "app.cli", "chat", str(smollm2_gguf), "--session", str(other),
                           "--kv-bits", "8"], input="/exit\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "KV bits 32 in the file, 8 here" in proc.stderr
