"""`colibri plan MODEL --max-memory SIZE [--ctx N]`: the plan a budget gives, and its predicted speed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `plan` command."""
    parser = subparsers.add_parser(
        "plan", help="show how a model fits a memory budget",
        description="Measure each weight matrix's quantization error on calibration text, fit the model into "
        "the memory budget (minus KV cache for --ctx and measured overhead) and print bits per matrix group, "
        "what stays resident, what must stream from disk, and the decode speed predicted from RAM and disk "
        "bandwidth measured now. Nothing is written; `colibri convert --max-memory` makes the container.",
    )
    parser.add_argument("model", metavar="MODEL", help="a model folder, .gguf file or pulled name")
    parser.add_argument("--max-memory", required=True, metavar="SIZE", help="the whole memory budget, e.g. 2GB")
    parser.add_argument("--ctx", type=int, default=4096, metavar="N", help="context to hold (default 4096)")
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128), default=32, metavar="G")
    parser.add_argument("--calib", type=Path, metavar="FILE", help="calibration text (default: written by the model)")
    parser.add_argument("--calib-tokens", type=int, default=2048, metavar="N")
    parser.add_argument("--stream-bits", type=int, choices=(2, 3, 4, 5, 6, 8), default=4,
                        help="width of routed experts that stream from disk when the model does not fit (default 4)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from app.bench import measure_bandwidth
    from app.budget import process_rss, split_budget
    from app.convert import ConvertSettings
    from app.plan import describe, measure_disk_bandwidth, predict
    from app.pull import resolve_model
    from app.sizes import parse_size
    from engine.calibration import collect_stats
    from engine.loader import open_checkpoint
    from engine.models.transformer import Transformer
    from app.calibrate import calibration_sequences

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    baseline = process_rss()
    path = resolve_model(args.model)
    ckpt = open_checkpoint(path)
    split = split_budget(ckpt.spec, parse_size(args.max_memory, "--max-memory"), args.ctx, baseline)
    model = Transformer(ckpt.spec, ckpt.source)
    seqs = calibration_sequences(model, ckpt.tokenizer, ckpt.stop_ids, args.calib, args.calib_tokens, log)
    stats = collect_stats(model, seqs)
    del model
    ram = measure_bandwidth()
    disk = measure_disk_bandwidth(path if path.is_dir() else path.parent)
    prediction = predict(ckpt, split, stats, ConvertSettings(group=args.group_size), args.stream_bits, ram, disk, log)
    print(describe(prediction))
    return 0
