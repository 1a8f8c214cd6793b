"""`colibri synth SHAPE OUT`: write a random-weight checkpoint of a real architecture (see app.bench.synth)."""

from __future__ import annotations

import argparse
import sys
import time

from engine.errors import ColibriError


def _shapes_help() -> str:
    from app.bench.synth import SHAPES

    lines = [f"  {s.name:<13} {s.config['architectures'][0]}: {s.summary}" for s in SHAPES.values()]
    return "shapes (`colibri synth --list` adds their sizes):\n" + "\n".join(lines)


def _shapes_text() -> str:
    from app.bench.synth import SHAPES, plan_checkpoint

    rows = []
    for shape in SHAPES.values():
        plan = plan_checkpoint(shape.name, "bf16")
        rows.append(f"  {shape.name:<13} {plan.total_params / 1e9:6.3f} B params, {plan.active_params / 1e9:6.3f} B active, "
                    f"{plan.nbytes / 1e9:6.2f} GB bf16  {shape.config['architectures'][0]}: {shape.summary}")
    return "\n".join(rows)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `synth` command."""
    parser = subparsers.add_parser(
        "synth",
        help="write a random-weight checkpoint of a real architecture, for benchmarks",
        description="Write a Hugging Face folder (config.json, safetensors, a SentencePiece tokenizer) with "
        "seeded random weights of a real architecture's shape: something to benchmark without downloads. "
        "The folder appears only when complete. With --bits B it is instead the Colibri container `colibri convert "
        "--bits B` would make of it, written directly (random codes and scales: no bfloat16 detour), resumable. "
        "Needs the sentencepiece package (pip install 'colibri[bench]').",
        epilog=_shapes_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("shape", metavar="SHAPE", nargs="?", help="the architecture shape (see --list)")
    parser.add_argument("out", metavar="OUT", nargs="?", help="the folder to create")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="random seed of the weights (default 0)")
    parser.add_argument("--dtype", default="bf16", metavar="bf16|f16|f32", help="stored weight type (default bf16)")
    parser.add_argument("--bits", type=int, default=None, metavar="B",
                        help="write a quantized Colibri container (as `colibri convert --bits B` writes it) with "
                        "random codes and scales, instead of a Hugging Face folder: 2, 3, 4, 5, 6 or 8")
    parser.add_argument("--group", type=int, default=32, metavar="G",
                        help="with --bits: weights per scale, 32, 64 or 128 (default 32, as convert)")
    parser.add_argument("--layers", type=int, default=None, metavar="N",
                        help="write only the shape's first N decoder layers (their published shapes)")
    parser.add_argument("--list", action="store_true", help="list the shapes with their parameter counts and exit")
    parser.set_defaults(func=_run)


class _Reporter:
    """Progress on stderr: a live line on a terminal, a line per tenth otherwise."""

    def __init__(self, label: str):
        self.label = label
        self.live = sys.stderr.isatty()
        self.tenth = -1
        self.width = 0
        self.start: tuple[float, int] | None = None     # (time, bytes) when the weights began

    def __call__(self, done: int, total: int, what: str) -> None:
        fraction = done / total if total else 1.0
        now = time.perf_counter()
        if what == "tokenizer":
            self.start = None           # the rate and time left count the weights only
        elif self.start is None or done < self.start[1]:
            self.start = (now, done)
        rate = (done - self.start[1]) / (now - self.start[0]) if self.start and now > self.start[0] else 0.0
        left = f", {(total - done) / rate:.0f} s left at {rate / 1e6:.0f} MB/s" if rate > 0 and done < total else ""
        line = f"{self.label}: {fraction * 100:3.0f}% {what} ({done / 1e9:.2f}/{total / 1e9:.2f} GB{left})"
        if self.live:
            self.width = max(self.width, len(line))
            print(f"\r{line:<{self.width}}", end="", file=sys.stderr, flush=True)
        elif int(fraction * 10) > self.tenth:
            self.tenth = int(fraction * 10)
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.live and self.width:
            print(file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    from app.bench.synth import DTYPES, get_shape, write_checkpoint

    if args.list:
        print(_shapes_text())
        return 0
    if args.shape is None or args.out is None:
        raise ColibriError("give a SHAPE and an OUT folder, e.g. `colibri synth mixtral-1.7b ./mixtral-1.7b` "
                           "(`colibri synth --list` shows the shapes)")
    if args.dtype not in DTYPES:
        raise ColibriError(f"--dtype {args.dtype!r}: choose one of {', '.join(DTYPES)}")
    if args.seed < 0:
        raise ColibriError(f"--seed {args.seed}: use 0 or more")   # numpy's generators take no negative seed
    get_shape(args.shape)
    reporter = _Reporter(f"synth {args.shape}")
    t0 = time.perf_counter()
    if args.bits is not None:
        from app.bench.synth import write_container

        try:
            cplan = write_container(args.shape, args.out, bits=args.bits, group=args.group, seed=args.seed,
                                    layers=args.layers, progress=reporter)
        finally:
            reporter.close()
        end = time.perf_counter()
        weights = end - (reporter.start[0] if reporter.start else t0)
        print(f"wrote {args.out}: a Colibri container of {cplan.synth.shape.config['architectures'][0]}, "
              f"{cplan.synth.total_params / 1e9:.3f} B parameters ({cplan.synth.spec.n_layers} layers), "
              f"{cplan.plan.bits_per_weight:.2f} bits per weight, {cplan.nbytes / 1e9:.2f} GB of weights in "
              f"{weights:.1f} s ({cplan.nbytes / 1e6 / max(weights, 1e-9):.0f} MB/s; {end - t0:.1f} s in all, "
              "with the tokenizer)", file=sys.stderr)
        return 0
    try:
        plan = write_checkpoint(args.shape, args.out, seed=args.seed, dtype=args.dtype, progress=reporter,
                                layers=args.layers)
    finally:
        reporter.close()
    print(f"wrote {args.out}: {plan.shape.config['architectures'][0]}, {plan.total_params / 1e9:.3f} B parameters "
          f"({plan.active_params / 1e9:.3f} B active per token), {plan.nbytes / 1e9:.2f} GB {args.dtype} "
          f"in {len(plan.files)} file(s), {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
