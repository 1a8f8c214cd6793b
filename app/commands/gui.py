"""`colibri gui [MODEL]` (also the `colibri-gui` program): the desktop app, chat and live inspector;
`colibri gui --remote URL [--api-key KEY]`: the same app on a Colibri server on another machine.

The only module of `app` that imports `ui`, and only once the display has been checked: without
one, it says why and what to run instead.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Callable

from app.commands._common import add_model_argument, add_speculative_argument
from app.commands._memory import add_memory_arguments, load_options
from app.config.runtime import display_problem
from engine.errors import ColibriError

if TYPE_CHECKING:
    from app.service.local import LoadOptions


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `gui` command."""
    parser = subparsers.add_parser(
        "gui",
        help="open the desktop app (chat and live inspector)",
        description="The desktop app: chat with streaming answers and watch the engine at work (expert heat, "
        "memory tiers, I/O). MODEL opens at start; the memory flags set how it loads (the sliders change the "
        "budget, read-ahead and context while it runs). With --remote URL the app chats with a `colibri serve` "
        "on another machine and its inspector watches that server live (its settings are set where it runs).",
    )
    add_model_argument(parser, required=False)
    parser.add_argument("--ctx", type=int, default=None, metavar="N",
                        help="context length in tokens (default: 4096 or the model's limit)")
    parser.add_argument("--check-display", action="store_true",
                        help="only check that a display is available (exit 0) or say why not (exit 3)")
    # the packaged app's check: load MODEL, answer PROMPT, print timings as JSON, quit (exit 0 when it answered)
    parser.add_argument("--self-test", metavar="PROMPT", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--self-test-tokens", type=int, default=8, metavar="N", help=argparse.SUPPRESS)
    parser.add_argument("--remote", metavar="URL", default=None,
                        help="connect to a Colibri server (`colibri serve`) at URL, e.g. http://192.168.1.20:8080, "
                        "instead of opening a model here")
    parser.add_argument("--api-key", metavar="KEY", default=None,
                        help="with --remote: the key the server was started with (`colibri serve --api-key KEY`)")
    parser.add_argument("--lang", choices=("system", "en", "zh_CN"), default=None,
                        help="the language of the window for this run: system (the default: the system's), en, or "
                        "zh_CN (Simplified Chinese); File > Settings > Language keeps a choice")
    add_memory_arguments(parser)
    add_speculative_argument(parser)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    problem = display_problem()
    if args.check_display:
        if problem:
            print(f"colibri gui: {problem}", file=sys.stderr)
            return 3
        return 0
    if problem:
        raise ColibriError(problem)
    if args.remote and args.model:
        raise ColibriError(f"give either a MODEL to open here ({args.model}) or --remote URL, not both: the server "
                           "at URL chooses its model")
    if args.self_test is not None and not (args.model or args.remote):
        raise ColibriError("--self-test needs a MODEL to open (or --remote URL)")
    if args.remote:
        from app.service.remote import Endpoint

        Endpoint.parse(args.remote)     # a malformed address is refused before any window opens
    options = load_options(args)
    try:
        from ui.selftest import SelfTest
        from ui.startup import run
    except ImportError as exc:  # the GUI's packages are runtime dependencies, but a broken install says so
        raise ColibriError(f"the desktop app cannot start ({exc}); reinstall Colibri: pip install -e .") from None
    check = SelfTest(args.self_test, args.self_test_tokens) if args.self_test is not None else None
    argv = getattr(args, "command_line", None)
    return run(args.model, options, self_test=check, remote=args.remote, api_key=args.api_key, language=args.lang,
               options_for=_options_for(argv), asked=_asked(argv))


# the options the window's sliders set, by dest, and the names of the live settings they set there
SLIDERS = {"max_memory": "memory_budget", "ctx": "context_length", "prefetch_depth": "prefetch_depth",
           "io_threads": "io_threads"}


def _asked(argv: list[str] | None) -> frozenset[str] | None:
    """The sliders' settings the command line asks for by flag or COLIBRI_* variable: they win over the sliders'
    remembered positions, which win over settings files (a model's colibri.toml); None without the command line."""
    if argv is None:
        return None
    from app.cli import build_parser
    from app.config import settings

    return frozenset(SLIDERS[d] for d in settings.asked_for(build_parser(), argv, "gui") if d in SLIDERS)


def _options_for(argv: list[str] | None) -> Callable[[str], LoadOptions] | None:
    """How the window loads a model it opens after it started: as `colibri gui MODEL` would, with MODEL's
    colibri.toml under the same flags (None without the command line: the start's options serve every model)."""
    if argv is None:
        return None

    def options_for(model: str) -> LoadOptions:
        from app.cli import build_parser
        from app.config import settings

        return load_options(settings.for_model(build_parser(), argv, "gui", model))

    return options_for


def main() -> int:
    """The `colibri-gui` program: `colibri gui` with the same arguments."""
    from app.config.runtime import prepare_process

    prepare_process()   # before anything imports numba (cli_main does it again, harmlessly)
    from app.cli import main as cli_main

    return cli_main(["gui", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
