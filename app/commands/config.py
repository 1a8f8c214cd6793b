"""`colibri config show [COMMAND] [MODEL] [OPTIONS]`: the merged settings of a command and where each came from.

Read-only: it merges exactly as the command would (app.config.settings), without loading a model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.errors import ColibriError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `config` command and its `show` action."""
    from app.config.settings import ORDER, PROFILES, SETTINGS_COMMANDS

    parser = subparsers.add_parser(
        "config",
        help="show the settings run, chat, serve and gui would use",
        description="Every option of run, chat, serve and gui can live in a colibri.toml: the user's (in the user "
        "config folder), the model's (in its folder or beside its .gguf) or one given with --config. A key is the "
        "long option's name (max_memory or max-memory), at top level or in a [run], [chat], [serve] or [gui] "
        "table; COLIBRI_MAX_MEMORY=9GB sets it from the environment; --profile picks a preset. "
        f"Order, lowest to highest: {ORDER}.",
    )
    actions = parser.add_subparsers(title="actions", metavar="ACTION", dest="config_action", required=True)
    show = actions.add_parser(
        "show",
        help="print every option of a command, its merged value and its source",
        description="Print every option of COMMAND (default run) with the value it would run with and where the "
        "value came from: default, profile:NAME, a file, env COLIBRI_X or flag. Everything after COMMAND is "
        "read as that command's arguments, so `colibri config show run MODEL --kv-bits 8` shows what "
        "`colibri run MODEL --kv-bits 8` would use.",
    )
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.add_argument("--config", metavar="FILE", help="a settings file, as the command's --config")
    show.add_argument("--profile", choices=tuple(PROFILES), help="a profile, as the command's --profile")
    show.add_argument("target", nargs="?", metavar="COMMAND",
                      help=f"one of {', '.join(SETTINGS_COMMANDS)} (default run); anything else is taken as MODEL")
    show.add_argument("rest", nargs=argparse.REMAINDER, metavar="ARGS", help="MODEL and options of COMMAND")
    show.set_defaults(func=_show)


def parse_loosely(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse a command's arguments with nothing required: showing settings needs no prompt or MODEL."""
    for action in parser._actions:
        action.required = False
    for group in parser._mutually_exclusive_groups:
        group.required = False
    return parser.parse_args(argv)


def _show(args: argparse.Namespace) -> int:
    from app.cli import build_parser
    from app.config import settings

    command, rest = args.target or "run", list(args.rest)
    if command not in settings.SETTINGS_COMMANDS:
        command, rest = "run", [command, *rest]
    if args.config is not None:
        rest = ["--config", args.config, *rest]
    if args.profile is not None:
        rest = ["--profile", args.profile, *rest]
    parsers = settings.command_parsers(build_parser())       # a fresh parser: loosening it harms no one
    if command not in parsers:
        raise ColibriError(f"`colibri {command}` is not available in this version; "
                           f"show one of {', '.join(parsers)}")
    parser = parsers[command]
    command_args = parse_loosely(parser, rest)
    given = settings.explicit_dests(parser, rest, parser)
    resolved = settings.resolve(command, parsers, command_args, given)
    for notice in resolved.notices:                          # tuned values ignored, and why
        print(f"colibri: {notice}", file=sys.stderr)
    if args.json:
        print(json.dumps(as_dict(resolved), default=str, indent=2))
    else:
        sys.stdout.write(as_text(resolved))
    return 0


def _masked(setting):
    """A secret's value hidden (serve's api_key): the output gets pasted into bug reports."""
    secret = {"key", "secret", "password"} & set(setting.key.split("_"))
    return "****" if secret and setting.value is not None else setting.value


def _shown(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) if value else "[]"
    return str(value)


def as_text(resolved) -> str:
    """The aligned table: key, value, source; a header names the order, the profile and the files read."""
    from app.config.settings import ORDER, PROFILES, user_file

    lines = [f"# colibri {resolved.command}: {ORDER}"]
    if resolved.profile is not None:
        p = resolved.profile
        lines.append(f"# profile {p.name}: {p.summary}; sets "
                     + ", ".join(f"{k} = {'unset' if v is None else _shown(v)}" for k, v in p.values.items()))
    else:
        lines.append("# profiles: " + "; ".join(f"{p.name} ({p.summary})" for p in PROFILES.values()))
    read = ", ".join(str(path) for path in resolved.files) or "none"
    lines.append(f"# files read: {read} (the user file is {user_file()})")
    rows = [(s.key.replace("_", "-"), _shown(_masked(s)), s.source) for s in resolved.settings.values()]
    rows.insert(0, ("KEY", "VALUE", "SOURCE"))
    wk, wv = (max(len(r[i]) for r in rows) for i in (0, 1))
    lines += [f"{k:<{wk}}  {v:<{wv}}  {src}".rstrip() for k, v, src in rows]
    return "\n".join(lines) + "\n"


def as_dict(resolved) -> dict:
    """JSON-ready: the command, the profile, the files and every setting with its source."""
    return {
        "command": resolved.command,
        "profile": resolved.profile.name if resolved.profile is not None else None,
        "files": [str(Path(p)) for p in resolved.files],
        "settings": {s.key: {"value": _masked(s), "source": s.source, "option": s.option}
                     for s in resolved.settings.values()},
    }
