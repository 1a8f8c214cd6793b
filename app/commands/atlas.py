"""`colibri atlas MODEL`: map which experts of an MoE each probe topic uses, into a sidecar file."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `atlas` command."""
    parser = subparsers.add_parser(
        "atlas",
        help="map what each expert of an MoE specialises in",
        description="Run the probe prompts (topics such as Python, law, Chinese) through an MoE model, count which "
        "experts each topic's tokens choose, and write the atlas: per expert its selections, topic distribution, "
        "specialisation, top topic, whether that topic reproduces on held-out prompts, and a 3D position. The file "
        "is bound to the model (by its hash) and refused for any other.",
    )
    parser.add_argument("model", metavar="MODEL", help="an MoE model: a folder, a .gguf file, or a pulled name")
    parser.add_argument("--out", type=Path, metavar="FILE",
                        help="the atlas file (default: MODEL/atlas.json, or MODEL.atlas.json beside a .gguf)")
    parser.add_argument("--probes", type=Path, metavar="DIR",
                        help="a folder of <topic>.json probe files (default: the shipped ones)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from app.atlas.build import report_text, run_atlas
    from app.commands.moefy import progress_printer
    from app.hub.pull import resolve_model

    model = resolve_model(args.model)
    sidecar, atlas = run_atlas(model, args.out, args.probes, progress_printer("atlas"))
    print(report_text(atlas))
    print(f"wrote {sidecar}")
    return 0
