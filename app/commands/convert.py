"""`colibri convert SRC OUT`: quantize a model into a Colibri container, planned under a budget."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.errors import ColibriError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `convert` command."""
    parser = subparsers.add_parser(
        "convert",
        help="quantize a model into a Colibri container",
        description="Convert a Hugging Face folder or a GGUF file into a Colibri container. With --bits every "
        "weight matrix gets that width; with --budget (weight bytes) or --max-memory (the whole memory, "
        "minus KV cache for --ctx and measured overhead) the planner measures each matrix's error on "
        "calibration text and picks widths that fit. A GGUF file given none of the three is kept as published: its "
        "K-quant, IQ4 and Q4_0-Q8_0 blocks are written unchanged (no second rounding), so the container gives the "
        "same answers as the file and can stream its experts under --max-memory. An interrupted conversion "
        "(killed, or stopped by a full disk; its work is kept in OUT.partial) resumes when rerun.",
    )
    parser.add_argument("src", metavar="SRC", help="a Hugging Face model folder, a .gguf file or a pulled name")
    parser.add_argument("out", metavar="OUT", type=Path, help="the container folder to write")
    size = parser.add_mutually_exclusive_group()    # none: a GGUF kept as published
    size.add_argument("--bits", type=int, choices=(2, 3, 4, 5, 6, 8), help="one width for every weight matrix")
    size.add_argument("--budget", metavar="SIZE", help="bytes for all weights, e.g. 80MB or 1.2GB")
    size.add_argument("--max-memory", metavar="SIZE", help="the whole memory budget (weights + KV cache + overhead)")
    parser.add_argument("--ctx", type=int, default=4096, metavar="N", help="context assumed by --max-memory (default 4096)")
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128), default=32, metavar="G",
                        help="weights per scale: 32, 64 or 128 (default 32; smaller where a row needs it)")
    parser.add_argument("--calib", type=Path, metavar="FILE", help="calibration text (default: the model writes some from the probes)")
    parser.add_argument("--calib-tokens", type=int, default=4096, metavar="N", help="calibration tokens (default 4096)")
    parser.add_argument("--keep-bits", action="append", default=[], metavar="PATTERN=BITS",
                        help="force a width (2-8, or 32 for float32) on matching tensors, e.g. '*lm_head*=8' (repeatable)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from app.config.sizes import format_size, parse_size
    from app.hub.convert import ConvertSettings, convert
    from app.hub.progress import to_stderr
    from app.hub.pull import resolve_model
    from app.plan.budget import process_rss, split_budget
    from engine.loader import open_checkpoint
    from engine.plan.planner import parse_keep_bits

    args.src = resolve_model(args.src)
    baseline = process_rss()
    budget = parse_size(args.budget, "--budget") if args.budget else None
    if args.max_memory:
        split = split_budget(open_checkpoint(args.src).spec, parse_size(args.max_memory, "--max-memory"), args.ctx, baseline)
        print(f"memory budget {split.describe()}", file=sys.stderr)
        budget = split.weights
    if args.calib_tokens < 64:
        raise ColibriError(f"--calib-tokens {args.calib_tokens}: use at least 64")
    settings = ConvertSettings(bits=args.bits, budget=budget, group=args.group_size, keep=tuple(parse_keep_bits(args.keep_bits)),
                               calib=args.calib, calib_tokens=args.calib_tokens)
    out = convert(args.src, args.out, settings, progress=to_stderr)
    from engine.formats.container import Container

    c = Container.open(out, verify=False)
    plan = c.manifest["plan"]
    print(f"{out}: {plan['bits_per_weight']:.2f} bits per weight, "
          f"{format_size(sum(e.length for e in c.entries.values()))} of weights, model hash {c.model_hash[:16]}")
    return 0
