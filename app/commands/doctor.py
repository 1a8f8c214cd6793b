"""`colibri doctor [--json]`: check this machine for Colibri, one line per finding (see app.doctor)."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `doctor` command."""
    parser = subparsers.add_parser(
        "doctor", help="check this machine: memory, disk, CPU, numba, display",
        description="Check what this machine offers Colibri: total and available memory, swap and vm.swappiness, "
        "the models folder's disk (file system, rotational or not, free space, a measured cold read, whether "
        "O_DIRECT works), CPU vector features, numba's threading layer, and whether the desktop app can open "
        "(display, Qt, OpenGL). Each line has a verdict and, when something is wrong, the fix. Takes a few "
        "seconds; writes and removes a 64 MB scratch file in the models folder. Exit code 1 when a check fails.",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list of {name, value, verdict, fix}")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from app.doctor import exit_code, format_check, iter_checks

    checks = []
    for check in iter_checks():
        checks.append(check)
        if not args.json:          # a line as soon as it is known: the disk and GUI probes take a moment
            print(format_check(check), flush=True)
    if args.json:
        print(json.dumps([c.as_dict() for c in checks], indent=2))
    return exit_code(checks)
