"""The `colibri` command line frame: version, help of every command, how errors end a command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import app.hub.pull
from app import cli
from engine import __version__
from engine.errors import ColibriError

REPO = Path(__file__).resolve().parents[2]


def colibri(*args: str, **env: str) -> subprocess.CompletedProcess:
    """Run `python -m app.cli ARGS` as a user would run `colibri ARGS`."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], cwd=REPO, capture_output=True, text=True,
        env=dict(os.environ, **env), timeout=120,
    )


def test_version() -> None:
    result = colibri("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"colibri {__version__}" == "colibri 0.1.0"


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "colibri"
    if not script.exists():
        pytest.skip("the project is not installed in this environment (run `make test`)")
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "colibri 0.1.0"


def test_help_lists_every_command() -> None:
    result = colibri("--help")
    assert result.returncode == 0
    for name in cli.COMMANDS:
        assert name in result.stdout


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: colibri {command}")


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "usage: colibri" in capsys.readouterr().err


def test_user_error_exits_2_without_traceback() -> None:
    result = colibri("pull", "not a model")
    assert result.returncode == 2
    assert result.stderr.startswith("colibri: error: ")
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_colibri_error_from_a_command(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def fail(*args, **kwargs):
        raise ColibriError("the model is missing: run `colibri pull NAME`")

    monkeypatch.setattr(app.hub.pull, "pull", fail)
    assert cli.main(["pull", "org/name"]) == 2
    assert capsys.readouterr().err == "colibri: error: the model is missing: run `colibri pull NAME`\n"


def test_ctrl_c_exits_130_quietly(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(app.hub.pull, "pull", interrupted)
    assert cli.main(["pull", "org/name"]) == 130
    assert capsys.readouterr().err == ""


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def bug(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(app.hub.pull, "pull", bug)
    with pytest.raises(ZeroDivisionError):
        cli.main(["pull", "org/name"])
