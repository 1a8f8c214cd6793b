"""`colibri plan MODEL --max-memory SIZE [--ctx N]`: whether a model fits a budget, how, and its predicted speed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.plan.plan import Prediction

BITS = (2, 3, 4, 5, 6, 8)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `plan` command."""
    parser = subparsers.add_parser(
        "plan", help="show whether and how a model fits a memory budget",
        description="Say first whether the model fits the memory budget (in memory, with experts streaming from "
        "disk, or not at all and what budget it needs), then the KV cache for --ctx, bits per matrix group, what "
        "stays resident and what streams, and the prompt and decode speed predicted from this machine's measured "
        "matmul speed and RAM and disk bandwidth. With the weights at hand each matrix's quantization error is "
        "measured on calibration text first; a Hugging Face repo id not pulled yet (or --config-only) is planned "
        "from its config.json alone, at fixed widths, before any download. Nothing is written; "
        "`colibri convert --max-memory` makes the container. Exit code 1 when the model does not fit.",
    )
    parser.add_argument("model", metavar="MODEL", nargs="?",
                        help="a model folder, .gguf file or pulled name; or a Hugging Face repo id (org/name) not "
                        "pulled yet, of which only config.json is fetched")
    parser.add_argument("--max-memory", required=True, metavar="SIZE", help="the whole memory budget, e.g. 2GB")
    parser.add_argument("--ctx", type=int, default=4096, metavar="N", help="context to hold (default 4096)")
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128), default=32, metavar="G")
    parser.add_argument("--calib", type=Path, metavar="FILE", help="calibration text (default: written by the model)")
    parser.add_argument("--calib-tokens", type=int, default=2048, metavar="N")
    parser.add_argument("--stream-bits", type=int, choices=BITS, default=4,
                        help="width of routed experts that stream from disk when the model does not fit (default 4)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="compute threads the speeds are predicted (and measured) for (default: the physical "
                        "cores, as `colibri run` uses)")
    g = parser.add_argument_group("planning from config.json alone")
    g.add_argument("--config-only", type=Path, metavar="PATH",
                   help="plan from this config.json (or a folder holding one): no weights, no calibration")
    g.add_argument("--bits", type=int, choices=BITS, default=4,
                   help="width of the dense matrices when planning from config.json (default 4; routed experts "
                   "take --stream-bits)")
    parser.set_defaults(func=_run)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _run(args: argparse.Namespace) -> int:
    from app.plan.budget import process_rss
    from app.plan.plan import BudgetTooSmall, describe

    baseline = process_rss()   # before any model is opened: the interpreter's and libraries' own share
    try:
        model, config = _source(args)
        prediction = (_plan_from_config(args, config, baseline) if config is not None
                      else _plan_calibrated(args, model, baseline))
    except BudgetTooSmall as exc:
        print(exc)
        return 1
    print(describe(prediction))
    return 0


def _source(args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """(the model on this machine, None) or (None, the config.json to plan from alone)."""
    from app.config.catalog import ALIASES, DERIVED, is_repo_id
    from app.hub.pull import resolve_model
    from app.plan.plan import fetch_config
    from engine.errors import ColibriError

    if args.config_only is not None:
        return None, args.config_only
    if args.model is None:
        raise ColibriError("plan what? pass MODEL (a model folder, .gguf file, pulled name or org/name) "
                           "or --config-only PATH/config.json")
    try:
        return resolve_model(args.model), None
    except ColibriError:
        if args.model in ALIASES or args.model in DERIVED or not is_repo_id(args.model):
            raise
    _log(f"{args.model} is not pulled: planning from its config.json alone")
    return None, fetch_config(args.model)


def _threads(args: argparse.Namespace) -> int:
    """--threads, or the physical cores capped at what numba started with (what `colibri run` uses)."""
    import numba

    from app.bench.decode import check_threads
    from app.config.settings import physical_cores

    if args.threads is None:
        return min(physical_cores(), numba.config.NUMBA_NUM_THREADS)
    check_threads(args.threads)
    return args.threads


def _measurer(args: argparse.Namespace, folder: Path):
    """The function that measures this machine for a planned Work (app.plan.plan.measure_rates, with these flags)."""
    from app.plan import plan
    threads = _threads(args)
    _log(f"measuring this machine's speeds ({threads} thread{'s' if threads != 1 else ''}) ...")
    return lambda work: plan.measure_rates(work, args.ctx, threads, folder)


def _plan_from_config(args: argparse.Namespace, config: Path, baseline: int) -> Prediction:
    """Fixed widths from config.json alone; speeds measured now, the disk's in the models folder."""
    from app.config.paths import models_dir
    from app.config.sizes import parse_size
    from app.plan.plan import config_checkpoint, config_layout, predict, split_for

    ckpt = config_checkpoint(config)
    split = split_for(ckpt.spec, parse_size(args.max_memory, "--max-memory"), args.ctx, baseline)
    layout = config_layout(ckpt, split, args.bits, args.stream_bits, args.group_size)
    _log(f"planned from {ckpt.path / 'config.json'} alone: dense matrices at {args.bits} bits, routed experts at "
         f"{args.stream_bits} bits, no calibration")
    return predict(ckpt.spec, split, layout, _measurer(args, models_dir()))


def _plan_calibrated(args: argparse.Namespace, path: Path, baseline: int) -> Prediction:
    """Widths from each matrix's error measured on calibration text; the disk measured where the model lies."""
    from app.config.sizes import parse_size
    from app.hub.calibrate import calibration_sequences
    from app.hub.convert import ConvertSettings
    from app.plan.plan import calibrated_floor, calibrated_layout, predict, split_for
    from engine.formats.container import is_container
    from engine.loader import open_checkpoint
    from engine.models.transformer import Transformer
    from engine.plan.calibration import collect_stats

    ckpt = open_checkpoint(path)
    settings = ConvertSettings(group=args.group_size)
    split = split_for(ckpt.spec, parse_size(args.max_memory, "--max-memory"), args.ctx, baseline)
    if is_container(path):                                       # quantized already: its widths are given
        from app.plan.plan import container_layout

        layout = container_layout(ckpt, split)
        _log(f"{path} is a Colibri container: its own widths, no calibration")
        return predict(ckpt.spec, split, layout, _measurer(args, path))
    calibrated_floor(ckpt, split, settings, args.stream_bits)    # a hopeless budget is said before calibrating
    model = Transformer(ckpt.spec, ckpt.source)
    seqs = calibration_sequences(model, ckpt.tokenizer, ckpt.stop_ids, args.calib, args.calib_tokens, _log)
    stats = collect_stats(model, seqs)
    del model
    layout = calibrated_layout(ckpt, split, stats, settings, args.stream_bits, _log)
    return predict(ckpt.spec, split, layout, _measurer(args, path if path.is_dir() else path.parent))
