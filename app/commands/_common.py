"""What `run`, `chat` and `bench` share: the MODEL argument, sampling flags, loading with progress."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from app.service.loading import DEFAULT_CONTEXT, LoadPlan
from app.service.messages import LoadOptions
from engine.errors import ColibriError
from engine.generation.sampling import SamplingParams
from engine.tokenizer.text import clean_text


def add_model_argument(parser: argparse.ArgumentParser, required: bool) -> None:
    """MODEL: a folder, a .gguf file, or a pulled name."""
    help_text = "a model folder, a .gguf file, or a name pulled with `colibri pull`"
    if required:
        parser.add_argument("model", metavar="MODEL", help=help_text)
    else:
        from app.hub.pull import DEFAULT_MODEL

        parser.add_argument("model", metavar="MODEL", nargs="?", default=None,
                            help=help_text + f" (default: {DEFAULT_MODEL}, prepared on first use)")
        # the settings read the default model's own colibri.toml when MODEL is left out (app.config.settings.resolve)
        parser.set_defaults(default_model=DEFAULT_MODEL)


def add_sampling_arguments(parser: argparse.ArgumentParser, temperature: float, repetition_penalty: float) -> None:
    """--max-tokens, --temperature, --top-p, --top-k, --min-p, penalties, --seed, --stop, --ctx."""
    g = parser.add_argument_group("generation")
    g.add_argument("--max-tokens", type=int, default=256, metavar="N", help="most tokens to generate (default 256)")
    g.add_argument("--temperature", type=float, default=temperature, metavar="T", help=f"0 is greedy (default {temperature})")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K likeliest tokens (default 0: off)")
    g.add_argument("--min-p", type=float, default=0.0, metavar="P", help="drop tokens below P x the top probability (default 0: off)")
    g.add_argument("--repetition-penalty", type=float, default=repetition_penalty, metavar="R",
                   help=f"CTRL-style penalty on seen tokens, 1 is off (default {repetition_penalty})")
    g.add_argument("--presence-penalty", type=float, default=0.0, metavar="X", help="OpenAI presence penalty (default 0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X", help="OpenAI frequency penalty (default 0)")
    g.add_argument("--seed", type=int, default=None, metavar="S", help="random seed for sampling")
    g.add_argument("--stop", action="append", default=[], type=clean_text, metavar="TEXT", help="stop when TEXT is generated (repeatable)")
    g.add_argument("--ctx", type=int, default=None, metavar="N", help="context length in tokens (default: the model's)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the flags, checked (with --max-tokens, which the same group holds)."""
    if args.max_tokens < 1:
        raise ColibriError(f"--max-tokens {args.max_tokens}: generate at least one token")
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
    )
    params.validate()
    return params


def show_plan(plan: LoadPlan) -> None:
    """Print how the memory budget divides (stderr), with what the process already takes outside it."""
    from app.config.sizes import format_size
    from app.plan.budget import process_rss

    print(f"{plan.description}; the interpreter and libraries take {format_size(process_rss())} more (measured "
          "before loading, not counted)", file=sys.stderr)


def budget_plan(path: Path, options: LoadOptions, quiet: bool = False) -> LoadPlan:
    """How the container at `path` loads under the budget of `options` (its split shown unless quiet)."""
    from app.config.paths import usage_dir
    from app.service.loading import plan_offload

    found = plan_offload(options, path, usage_dir() if options.history else None)
    if not quiet:
        show_plan(found)
    return found


def streamable(path: Path, options: LoadOptions | None, quiet: bool = False) -> Path:
    """The model to load: `path`, or for a GGUF given a memory budget the container that streams it (converted once,
    as published, into the data dir: app/hub/gguf_cache.py; its progress on stderr unless quiet)."""
    from app.hub.gguf_cache import container_for, is_gguf

    if options is None or options.max_memory is None or not is_gguf(path):
        return path
    return container_for(path, (lambda event: None) if quiet else None)


def load(model_arg: str | None, quiet: bool = False, options: LoadOptions | None = None, telemetry=None):
    """Resolve MODEL and load it, reporting progress on stderr (a terminal gets a live line).

    With `options` naming a memory budget (--max-memory), the weights are offloaded under it (a GGUF file is
    converted once, as published, to stream: `streamable`).
    """
    from app.hub.pull import resolve_model
    from engine.loader import load_model
    from engine.telemetry import NULL

    path = streamable(resolve_model(model_arg), options, quiet)
    offload = None
    if options is not None and options.max_memory is not None:
        offload = budget_plan(path, options, quiet).offload
    live = sys.stderr.isatty() and not quiet
    t0 = time.perf_counter()

    width = 0

    def progress(fraction: float, message: str) -> None:
        nonlocal width
        if live:
            line = f"loading {path.name}: {fraction * 100:3.0f}% {message}"
            width = max(width, len(line))
            print(f"\r{line:<{width}}", end="", file=sys.stderr, flush=True)

    loaded = load_model(path, progress, offload, telemetry if telemetry is not None else NULL)
    if live:
        print("\r" + " " * width + "\r", end="", file=sys.stderr)
    if not quiet:
        print(f"loaded {path.name} ({loaded.spec.architecture}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return loaded


def context_length(loaded, ctx: int | None) -> int:
    """The --ctx value, checked against what the model supports (default: the model's limit; for offloaded
    weights the context the budget was divided for)."""
    limit = loaded.spec.max_position
    if ctx is None:
        return limit if loaded.store is None else min(limit, DEFAULT_CONTEXT)
    if ctx < 1:
        raise ColibriError(f"--ctx {ctx}: the context must hold at least one token")
    if ctx > limit:
        raise ColibriError(f"--ctx {ctx}: {loaded.name} knows positions up to {limit}; use --ctx {limit} or less")
    return ctx


def speculative_mode(text: str) -> bool | str:
    """--speculative's value: "mtp", or on/off words (a settings file's or variable's true/false)."""
    word = text.strip().lower()
    if word == "mtp":
        return "mtp"
    if word in ("true", "1", "yes", "on", "lookup"):
        return True
    if word in ("false", "0", "no", "off"):
        return False
    # a model named right after the bare flag is read as its value: say how to order them
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a speculation mode: give `--speculative` alone (prompt lookup) or `--speculative mtp`, "
        "and name the model before the flag (`colibri run MODEL --speculative --prompt ...`)")


speculative_mode.description = "mtp, or true or false"    # type: ignore[attr-defined]  # settings' error text


def add_speculative_argument(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """--speculative [mtp] and --draft K (chat, serve, gui through the scheduler; run adds --draft-model to the
    group it returns)."""
    g = parser.add_argument_group("speculative decoding (the same output, faster when text repeats)")
    g.add_argument("--speculative", nargs="?", const=True, default=False, type=speculative_mode, metavar="mtp",
                   help="draft tokens from n-grams of the conversation and verify them in one pass, per answer; "
                        "switches itself off when it does not pay (off by default). `--speculative mtp` drafts "
                        "with the checkpoint's multi-token-prediction layer instead (DeepSeek-V3, GLM-4.5, GLM-5)")
    g.add_argument("--draft", type=int, default=None, metavar="K",
                   help="tokens drafted per step (default 4; 1 with mtp, whose later guesses feed on its own)")
    return g
