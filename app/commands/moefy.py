"""`colibri moefy SRC OUT`: upcycle a dense Llama-family model into a Mixtral-style MoE checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from app.moefy.upcycle import MoefyOptions


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `moefy` command."""
    d = MoefyOptions()
    parser = subparsers.add_parser(
        "moefy",
        help="derive a Mixture-of-Experts model from a dense one (sparse upcycling)",
        description="Turn a dense Llama-family model (a folder or .gguf, e.g. SmolLM2) into a Mixtral-architecture "
        "MoE written as a Hugging Face checkpoint: each layer's feed-forward network becomes E slightly perturbed "
        "copies, and a router sends each token to the expert whose k-means cluster of feed-forward inputs it falls "
        "in. Calibration text is --calib, or chats the model has through the probe prompts. Prints perplexity "
        "against the dense model and each expert's share of tokens, and saves them in OUT/moefy_report.json.",
    )
    parser.add_argument("src", metavar="SRC", help="the dense model: a folder, a .gguf file, or a pulled name")
    parser.add_argument("out", metavar="OUT", type=Path, help="the folder to create for the MoE checkpoint")
    parser.add_argument("--experts", type=int, default=d.experts, metavar="E", help=f"experts per layer (default {d.experts})")
    parser.add_argument("--top-k", type=int, default=d.top_k, metavar="K", help=f"experts per token (default {d.top_k})")
    parser.add_argument("--calib", type=Path, metavar="FILE", help="calibration text file (default: the model's own chats "
                        "through the probe prompts)")
    parser.add_argument("--seed", type=int, default=d.seed, metavar="S", help=f"seed of k-means and perturbations (default {d.seed})")
    parser.add_argument("--noise", type=float, default=d.noise, metavar="X",
                        help=f"relative perturbation of each expert's weights (default {d.noise})")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=d.dtype, help=f"weights written as (default {d.dtype})")
    parser.add_argument("--calib-prompts", type=int, default=d.calib_prompts, metavar="N",
                        help=f"probe prompts per topic the model answers for calibration (default {d.calib_prompts})")
    parser.add_argument("--heldout-prompts", type=int, default=d.heldout_prompts, metavar="N",
                        help=f"other probe prompts per topic answered for the held-out report (default {d.heldout_prompts})")
    parser.add_argument("--answer-tokens", type=int, default=d.answer_tokens, metavar="N",
                        help=f"tokens per answer in those chats (default {d.answer_tokens})")
    parser.add_argument("--probes", type=Path, metavar="DIR", help="a probes folder of <topic>.json files (default: the shipped ones)")
    parser.add_argument("--no-eval", dest="evaluate", action="store_false",
                        help="skip the held-out chats and the perplexity and routing measurements (about half the time); "
                        "the model is the same, its report says it was not measured")
    parser.set_defaults(func=_run)


def progress_printer(what: str) -> Callable[[float, str], None]:
    """A progress callback: a live line on a terminal, a line per stage otherwise (both on stderr)."""
    live = sys.stderr.isatty()
    state = {"width": 0, "stage": ""}

    def show(fraction: float, message: str) -> None:
        line = f"{what}: {fraction * 100:3.0f}% {message}"
        if live:
            state["width"] = max(state["width"], len(line))
            end = "\n" if fraction >= 1.0 else ""
            print(f"\r{line:<{state['width']}}", end=end, file=sys.stderr, flush=True)
            return
        stage = message.split(":")[0]
        if stage != state["stage"] or fraction >= 1.0:
            state["stage"] = stage
            print(line, file=sys.stderr, flush=True)

    return show


def _run(args: argparse.Namespace) -> int:
    from app.hub.pull import resolve_model
    from app.moefy.upcycle import format_report, moefy

    options = MoefyOptions(experts=args.experts, top_k=args.top_k, noise=args.noise, seed=args.seed, dtype=args.dtype,
                           calib=args.calib, calib_prompts=args.calib_prompts, heldout_prompts=args.heldout_prompts,
                           answer_tokens=args.answer_tokens, probes=args.probes,
                           evaluate=args.evaluate)
    src = resolve_model(args.src)
    result = moefy(src, args.out, options, progress_printer("moefy"))
    print(format_report(result))
    print(f"wrote {args.out} (report in {args.out / 'moefy_report.json'})")
    return 0
