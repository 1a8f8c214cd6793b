"""`colibri chat --session` under faults: two chats on one file, a folder, a damaged last turn, a full disk.

The model is the tiny chat MoE (a character tokenizer; greedy answers run to --max-tokens), so each
chat is a real process answering real turns in a few seconds.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support.disk import PAGE, fill, small_disk

REPO = Path(__file__).resolve().parents[2]
TURNS = ("Tell me about bees.\n", "And about wasps?\n", "And ants?\n")
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from support.tiny_chat import tiny_moe

    return tiny_moe(tmp_path_factory.mktemp("tiny"))


def _argv(model: Path, session: Path) -> list[str]:
    return [sys.executable, "-m", "app.cli", "chat", str(model), "--max-tokens", str(MAX_TOKENS),
            "--session", str(session)]


def _run(model: Path, session: Path, lines: str) -> subprocess.CompletedProcess:
    return subprocess.run(_argv(model, session), input=lines, capture_output=True, text=True, timeout=600, cwd=REPO)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("colibri: error:")]


class Chat:
    """A chat process driven line by line: waits on what it prints, never on the clock."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1, cwd=REPO)
        self.out, self.err, self.turns = "", "", 0
        self._chunks: queue.Queue[tuple[str, str]] = queue.Queue()
        self._readers = [threading.Thread(target=self._read, args=(f, name), daemon=True)
                         for f, name in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        for reader in self._readers:
            reader.start()

    def _read(self, f, name: str) -> None:
        for chunk in iter(lambda: f.read(1), ""):
            self._chunks.put((name, chunk))

    def wait_for(self, done, timeout: float = 600.0) -> None:
        """Take in output until done(self) holds; fail after timeout seconds."""
        deadline = time.monotonic() + timeout
        while not done(self):
            left = deadline - time.monotonic()
            ended = not any(r.is_alive() for r in self._readers) and self._chunks.empty()
            assert left > 0 and not ended, f"gave up waiting; stdout {self.out!r}, stderr {self.err!r}"
            try:
                name, chunk = self._chunks.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if name == "out":
                self.out += chunk
            else:
                self.err += chunk

    def say(self, line: str) -> None:
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    def turn(self, line: str) -> None:
        """One turn, answered and saved: an unknown command after it is answered only once the save is done."""
        self.turns += 1
        mark = f"unknown command /sync{self.turns}"
        self.say(f"{line}/sync{self.turns}\n")
        self.wait_for(lambda c: mark in c.err)

    def close(self, timeout: float = 300.0) -> int:
        self.proc.stdin.close()
        code = self.proc.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=10)
        while not self._chunks.empty():
            name, chunk = self._chunks.get()
            if name == "out":
                self.out += chunk
            else:
                self.err += chunk
        return code


@pytest.mark.slow
def test_a_second_chat_on_the_same_session_is_refused(model, tmp_path):
    path = tmp_path / "chat.session"
    first = Chat(_argv(model, path))
    try:
        first.wait_for(lambda c: "chatting with" in c.err)
        second = _run(model, path, "hello\n/exit\n")
        assert second.returncode == 2, second.stderr
        errors = _errors(second.stderr)
        assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr
        assert f"session file {path} is in use by process {first.proc.pid} (colibri chat" in errors[0]
        assert "close that chat first, or use another session file" in errors[0]
        first.turn(TURNS[0])
        first.say("/exit\n")
    finally:
        code = first.close()
    assert code == 0, first.err
    again = _run(model, path, "/exit\n")                # free once the first chat left; its turn was kept
    assert again.returncode == 0 and "(resumed 1 turn from" in again.stderr, again.stderr


def test_a_folder_as_session_is_a_clear_error(model, tmp_path):
    proc = _run(model, tmp_path, "/exit\n")
    assert proc.returncode == 2
    errors = _errors(proc.stderr)
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"session file {tmp_path} is a folder; name a file" in errors[0]


@pytest.mark.slow
def test_a_damaged_last_turn_is_dropped_with_a_warning(model, tmp_path):
    path = tmp_path / "chat.session"
    assert _run(model, path, TURNS[0] + TURNS[1] + "/exit\n").returncode == 0
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF                                    # the second turn's save, damaged
    path.write_bytes(bytes(data))
    orphan = tmp_path / ".chat.session.k3j9x0aa.tmp"    # and a temporary a killed save left
    orphan.write_bytes(b"half a session")
    proc = _run(model, path, "/exit\n")
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "the last turn was damaged and is dropped" in line]
    assert len(warnings) == 1 and str(path) in warnings[0] and "fails its checksum" in warnings[0], proc.stderr
    assert "(resumed 1 turn from" in proc.stderr
    assert not orphan.exists()


@pytest.mark.slow
def test_a_full_disk_keeps_the_chat_going(model, tmp_path):
    # the session's sizes after each turn, measured on a roomy disk (greedy: the same every run)
    sizes = []
    roomy = Chat(_argv(model, tmp_path / "roomy.session"))
    try:
        roomy.wait_for(lambda c: "chatting with" in c.err)
        for line in TURNS[:2]:
            roomy.turn(line)
            sizes.append((tmp_path / "roomy.session").stat().st_size)
    finally:
        assert roomy.close() == 0, roomy.err
    assert sizes[1] - sizes[0] > 3 * PAGE               # the second turn's append needs more than is left below

    with small_disk(4 << 20, tmp_path / "disk") as disk:
        path = disk / "chat.session"
        # room for the first save (whole pages) and the lock's one page, not for the second turn's append
        filler = fill(disk, leave=-(-sizes[0] // PAGE) * PAGE + PAGE)
        chat = Chat(_argv(model, path))
        try:
            chat.wait_for(lambda c: "chatting with" in c.err)
            chat.turn(TURNS[0])
            assert path.stat().st_size == sizes[0] and "could not save" not in chat.err, (sizes, chat.err)
            chat.turn(TURNS[1])                         # answered, then its save fails
            lines = [line for line in chat.err.splitlines() if "could not save" in line]
            assert len(lines) == 1, chat.err
            assert lines[0].startswith(f"warning: could not save the session to {path}: disk full (")
            assert f" of {sizes[1] - sizes[0]} bytes written); the chat goes on, unsaved: free space and the next " \
                   "turn saves again" in lines[0]
            assert path.stat().st_size == sizes[0], sizes   # still the first turn's save
            kept = tmp_path / "kept.session"
            kept.write_bytes(path.read_bytes())
            filler.unlink()
            chat.turn(TURNS[2])                         # the chat went on, and this save goes through
            chat.say("/exit\n")
        finally:
            code = chat.close()
        assert code == 0 and "Traceback" not in chat.err, chat.err
        assert chat.err.count(f"[{MAX_TOKENS} tokens,") == 3
        assert sum("could not save" in line for line in chat.err.splitlines()) == 1
        resumed = _run(model, path, "/exit\n")
        assert resumed.returncode == 0 and "(resumed 3 turns from" in resumed.stderr, resumed.stderr
    kept_run = _run(model, kept, "/exit\n")             # what the file held when the save failed: turn one
    assert kept_run.returncode == 0 and "(resumed 1 turn from" in kept_run.stderr, kept_run.stderr
