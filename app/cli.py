"""The `colibri` command line: builds the parser from the command modules and reports errors."""

from __future__ import annotations

import argparse
import errno
import importlib
import io
import os
import sys

from app.config import settings
from engine import __version__
from engine.errors import ColibriError

# Modules of `app.commands`, in the order `colibri --help` lists them: one line per command.
COMMANDS: list[str] = [
    "run",
    "chat",
    "pull",
    "convert",
    "plan",
    "info",
    "doctor",
    "warm",
    "eval",
    "synth",
    "bench",
    "tune",
    "moefy",
    "atlas",
    "gui",
    "serve",
    "config",
]


def build_parser() -> argparse.ArgumentParser:
    """The `colibri` parser with every command of COMMANDS registered."""
    parser = argparse.ArgumentParser(
        prog="colibri",
        description="Run language models, above all Mixture-of-Experts models, on computers "
        "whose memory cannot hold them.",
    )
    parser.add_argument("--version", action="version", version=f"colibri {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command")
    for name in COMMANDS:
        importlib.import_module(f"app.commands.{name}").register(subparsers)
    for command in settings.command_parsers(parser).values():
        settings.add_settings_arguments(command)    # --config, --profile, --threads on run, chat, serve, gui
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command named in ARGV (default: sys.argv[1:]) and return the process's exit code."""
    from app.config.runtime import prepare_process

    prepare_process()
    _replace_undecodable_input()
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.command_line = argv        # `gui` resolves the settings again for each model the window opens later
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command in settings.SETTINGS_COMMANDS:
            settings.configure(parser, args, argv, args.command)   # files, COLIBRI_* and profile under the flags
        return int(func(args) or 0)
    except ColibriError as exc:
        print(f"colibri: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:                 # `colibri info OUT | head`: the reader left; not an error of ours
        try:
            sys.stdout = open(os.devnull, "w")  # so that the interpreter's final flush stays quiet
        except OSError:
            pass
        return 0
    except OSError as exc:
        if exc.filename is None:
            raise                           # not about a file the user named: a bug keeps its traceback
        print(f"colibri: error: {_file_problem(exc)}", file=sys.stderr)
        return 2


# errno values that only a write can meet; any other failure on a named file is reported as a read
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


def _file_problem(exc: OSError) -> str:
    """'cannot read FILE: REASON' for an OSError that names a file (the path the user gave, or one under it)."""
    verb = "write" if exc.errno in _WRITE_ERRNOS else "read"
    reason = exc.strerror or type(exc).__name__
    target = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
    return f"cannot {verb} {target}: {reason}"


def _replace_undecodable_input() -> None:
    """Read stdin with errors="replace": a line of invalid UTF-8 becomes U+FFFD (the engine's text policy)
    instead of ending `colibri chat` with a UnicodeDecodeError."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="replace")


if __name__ == "__main__":
    sys.exit(main())
