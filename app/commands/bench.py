"""`colibri bench MODEL`: prompt and decode speed, bytes per token and the RAM roofline (see app.bench)."""

from __future__ import annotations

import argparse
import json
import sys

from app.commands._common import add_model_argument, load
from engine.errors import ColibriError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` command."""
    parser = subparsers.add_parser(
        "bench",
        help="measure prompt and decode speed against the RAM roofline",
        description="Time a random prompt of --prompt tokens and --gen greedy decode steps (a warm-up, then the "
        "median of --runs runs); report the weight bytes one decoded token reads, the bandwidth that achieves, "
        "the RAM read bandwidth measured on the spot, and the decode speed that bandwidth would allow.",
    )
    add_model_argument(parser, required=True)
    parser.add_argument("--prompt", type=int, default=128, metavar="N", help="prompt tokens per run (default 128)")
    parser.add_argument("--gen", type=int, default=64, metavar="N", help="decode steps per run (default 64)")
    parser.add_argument("--runs", type=int, default=3, metavar="N", help="timed runs after the warm-up (default 3)")
    parser.add_argument("--threads", type=int, default=2, metavar="N", help="numba and BLAS threads (default 2)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the random prompt (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(func=_run)


def _check(args: argparse.Namespace) -> None:
    for flag, value in (("--prompt", args.prompt), ("--gen", args.gen), ("--runs", args.runs)):
        if value < 1:
            raise ColibriError(f"{flag} {value}: must be at least 1")
    if args.runs > 1000:
        raise ColibriError(f"--runs {args.runs}: at most 1000 runs")


def format_table(r) -> str:
    """The human-readable report of a BenchResult."""
    runs = lambda values: " ".join(f"{v:.1f}" for v in values)  # noqa: E731
    return "\n".join([
        f"{r.model} ({r.architecture}), {r.threads} thread{'s' if r.threads != 1 else ''}, median of {r.runs} runs after a warm-up",
        f"  prompt    {r.prompt_tokens:5d} tokens  {r.prompt_tok_s:9.1f} tok/s   (runs {runs(r.prompt_tok_s_runs)})",
        f"  decode    {r.gen_tokens:5d} tokens  {r.decode_tok_s:9.1f} tok/s   (runs {runs(r.decode_tok_s_runs)})",
        f"  weights   {r.weight_bytes / 1e9:9.3f} GB resident, {r.bytes_per_token / 1e6:.1f} MB read per decoded token",
        f"  bandwidth {r.achieved_gb_s:9.2f} GB/s achieved of {r.ram_gb_s:.2f} GB/s RAM read measured "
        f"= {r.roofline_fraction * 100:.0f}% of the roofline",
        f"  roofline  {r.roofline_decode_tok_s:9.1f} tok/s decode if reading the weights were all it cost",
    ])


def _run(args: argparse.Namespace) -> int:
    from app.bench import bench_model, check_threads

    _check(args)
    check_threads(args.threads)  # before loading anything
    loaded = load(args.model, quiet=args.json)
    live = sys.stderr.isatty() and not args.json

    def on_run(done: int, total: int) -> None:
        if live:
            what = "warm-up" if done == 0 else f"run {done}/{total}"
            print(f"\rbench: {what}   ", end="", file=sys.stderr, flush=True)

    result = bench_model(loaded, prompt=args.prompt, gen=args.gen, runs=args.runs, threads=args.threads,
                         seed=args.seed, on_run=on_run)
    if live:
        print("\r" + " " * 24 + "\r", end="", file=sys.stderr)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(format_table(result))
    return 0
