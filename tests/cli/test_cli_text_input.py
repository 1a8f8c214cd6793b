"""`colibri run` and `colibri chat` with bytes that are not UTF-8 (issue 29): argv and stdin are real bytes
(the CLI runs as a subprocess), each invalid byte is read as U+FFFD, and nothing ends in a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.tiny_chat import tiny_models

pytestmark = pytest.mark.slow       # each case starts the CLI and loads the tiny model


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    folder, _ = tiny_models(tmp_path_factory.getbasetemp())
    return str(folder)


def _colibri(*args: str | bytes, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], input=stdin, capture_output=True, timeout=600)


def _ok(proc: subprocess.CompletedProcess) -> str:
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0 and "Traceback" not in err, err
    return proc.stdout.decode("utf-8")


def _answer(proc: subprocess.CompletedProcess) -> tuple:
    """What `run --json` generated (its speed figures vary from run to run)."""
    out = json.loads(_ok(proc))
    return out["tokens"], out["text"], out["prompt_tokens"], out["finish_reason"]


def test_run_reads_an_invalid_byte_in_the_prompt_as_the_replacement_character(model):
    # `colibri run MODEL --prompt "$(printf 'hi \xff')"`: Python hands the prompt over as "hi \udcff"
    generate = ("--max-tokens", "6", "--json")
    out = _answer(_colibri("run", model, "--prompt", b"hi \xff", *generate))
    assert out == _answer(_colibri("run", model, "--prompt", "hi \ufffd", *generate))


def test_run_chat_system_and_stop_with_invalid_bytes(model):
    dirty = ("run", model, "--chat", "--system", b"be \xed\xa0\x80 brief", "--prompt", b"\xc3(", "--stop", b"\xff\xfe")
    clean = ("run", model, "--chat", "--system", "be \ufffd\ufffd\ufffd brief", "--prompt", "\ufffd(",
             "--stop", "\ufffd\ufffd")
    generate = ("--max-tokens", "6", "--json")
    assert _answer(_colibri(*dirty, *generate)) == _answer(_colibri(*clean, *generate))


def test_chat_reads_invalid_utf8_on_stdin_and_keeps_chatting(model):
    # `printf 'hi \xed\xa0\x80\n' | colibri chat MODEL` ended the chat with a UnicodeDecodeError
    proc = _colibri("chat", model, "--max-tokens", "3", stdin=b"hi \xed\xa0\x80\nagain \xff\n/exit\n")
    _ok(proc)
    answered = [line for line in proc.stderr.decode().splitlines() if line.startswith("[3 tokens")]
    assert len(answered) == 2, proc.stderr.decode()
