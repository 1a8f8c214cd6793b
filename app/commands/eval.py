"""`colibri eval MODEL --text FILE [--reference MODEL]`: perplexity, KL and top-1 agreement."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.errors import ColibriError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `eval` command."""
    parser = subparsers.add_parser(
        "eval", help="measure a model's perplexity (and agreement with a reference)",
        description="Score a text file with MODEL: perplexity; with --reference also the mean KL divergence "
        "from the reference's next-token distribution and how often both pick the same top token.",
    )
    parser.add_argument("model", metavar="MODEL", help="a model folder, container, .gguf file or pulled name")
    parser.add_argument("--text", type=Path, required=True, metavar="FILE", help="the text to score (UTF-8)")
    parser.add_argument("--reference", metavar="MODEL", help="a reference model sharing the tokenizer (e.g. the unquantized source)")
    parser.add_argument("--ctx", type=int, default=512, metavar="N", help="window length in tokens (default 512)")
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N", help="score at most the first N tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from app.bench.evaluate import evaluate
    from app.commands._common import load

    try:
        text = args.text.read_text(encoding="utf-8", errors="replace")   # the engine's text policy: U+FFFD
    except OSError as exc:
        raise ColibriError(f"--text {args.text}: cannot read ({exc.strerror})") from None
    if args.ctx < 8:
        raise ColibriError(f"--ctx {args.ctx}: use at least 8 tokens")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ColibriError(f"--max-tokens {args.max_tokens}: score at least 2 tokens")
    loaded = load(args.model, quiet=args.json)
    if loaded.tokenizer is None:
        raise ColibriError(f"{loaded.name} has no tokenizer files: it cannot read text")
    ids = loaded.tokenizer.encode(text)[: args.max_tokens]
    reference = load(args.reference, quiet=args.json).model if args.reference else None
    result = evaluate(loaded.model, ids, min(args.ctx, loaded.spec.max_position), reference)
    if args.json:
        print(json.dumps(result.as_dict()))
        return 0
    print(f"{loaded.name}: perplexity {result.perplexity:.4f} over {result.tokens} tokens")
    if reference is not None:
        print(f"reference perplexity {result.ref_perplexity:.4f}; KL {result.kl:.5f} nats/token; "
              f"top-1 agreement {result.top1 * 100:.2f}%")
    return 0
