"""`colibri warm [MODEL]`: compile the kernels MODEL runs into Numba's cache before its first question."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `warm` command."""
    parser = subparsers.add_parser(
        "warm",
        help="compile a model's kernels ahead of its first question",
        description="Load MODEL as the app does and answer two short questions (greedy, then sampled at the "
        "chat window's defaults) so that every kernel it runs is compiled into Numba's cache "
        "(NUMBA_CACHE_DIR, else beside the installed modules). Once per install and kind of model: the first "
        "time takes minutes on a small machine, later ones seconds. A catalogue name (smollm2-moe, smollm2-135m) is "
        "pulled or prepared first when missing, and a model still to be upcycled has its kernels compiled on a "
        "small stand-in meanwhile, in another process; a hub name (org/name) is pulled first. `make run` does it before "
        "opening the terminal chat.",
    )
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="a model folder, container, GGUF file or a name to pull (default: the demo model, "
                        "smollm2-moe)")
    parser.add_argument("--models-dir", type=Path, default=None, metavar="DIR",
                        help="where a name is pulled to, or found (default: the models folder, as for pull)")
    # the app's first run: each event as a JSON line on stdout, read back by app.service.warm.warm_up_apart
    parser.add_argument("--events", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(func=_run)


EVERY = 15.0       # seconds between lines while one step compiles (the warm-up reports each second)


def _run(args: argparse.Namespace) -> int:
    import time

    from app.hub.progress import HubEvent, Progress, to_stderr
    from app.hub.pull import ALIASES, DEFAULT_MODEL, DERIVED, is_repo_id, pull
    from app.service.warm import event_line, warm_up

    last: list = [None, 0.0]        # the step last printed, and when

    def report(event: HubEvent) -> None:
        if args.events:
            print(event_line(event), flush=True)
            return
        now = time.monotonic()
        if isinstance(event, Progress) and event.done == last[0] and now - last[1] < EVERY:
            return
        last[:] = [event.done if isinstance(event, Progress) else None, now]
        to_stderr(event)

    model = args.model or DEFAULT_MODEL
    if model in DERIVED or model in ALIASES or (is_repo_id(model) and not Path(model).expanduser().exists()):
        model = pull(model, args.models_dir, progress=report, warm_ahead=True)
    warm_up(model, report)
    return 0
