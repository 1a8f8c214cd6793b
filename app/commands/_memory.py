"""The memory, offload and KV flags that `run`, `chat`, `bench`, `serve` and `gui` share, and the one place where
they become typed `LoadOptions` (nothing below app/commands reads an argparse namespace).

`--max-memory` turns offload on: the budget is divided (app.service.loading.plan_load) into resident weights,
KV cache, working buffers and the memory for offloaded weights, and the model loads with an expert store (MoE)
or a layer store (dense). The usage history that teaches the pins lives in the user's data folder.
"""

from __future__ import annotations

import argparse

from app.service.messages import LoadOptions
from engine.errors import ColibriError


def size_text(text: str) -> str:
    """An argparse type for sizes: checked now (so a settings file's bad value names its key), kept as text."""
    from app.config.sizes import parse_size

    try:
        parse_size(text, "--max-memory")
    except ColibriError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


size_text.description = "a size such as 9GB, 512MB or 1.5 (gigabytes)"   # how app.config.settings names it


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """--max-memory, --io, --io-threads, --prefetch-depth, --cache-policy, --resident-layers."""
    g = parser.add_argument_group("memory and streaming")
    g.add_argument("--max-memory", metavar="SIZE", type=size_text,
                   help="memory for the model (weights, expert cache, KV cache, buffers), e.g. 9GB or 512MB (a bare "
                        "number is GB); what does not fit streams from disk (needs a container: `colibri convert`)")
    g.add_argument("--io", choices=("pread", "mmap"), default="pread",
                   help="how streamed weights are read: pread into the cache (default) or mmap page faults (baseline)")
    g.add_argument("--io-threads", type=int, default=2, metavar="N", help="reader threads (default 2)")
    g.add_argument("--prefetch-depth", type=int, default=1, metavar="D",
                   help="layers read ahead while the current one computes (default 1; 0 is off)")
    g.add_argument("--cache-policy", choices=("lru", "lfru", "learned"), default="learned",
                   help="which cached expert leaves first (default learned: usage history plus recency)")
    g.add_argument("--resident-layers", type=int, default=None, metavar="N",
                   help="dense models: layers held in memory (default: as many as the budget allows)")
    g.add_argument("--no-history", action="store_true", help="neither read nor update the usage history")
    add_kv_arguments(parser)


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    """--kv-block-size, --kv-bits, --overflow."""
    from engine.kv import BLOCK_SIZE, OVERFLOW

    g = parser.add_argument_group("KV cache")
    g.add_argument("--kv-block-size", type=int, default=BLOCK_SIZE, metavar="N",
                   help=f"positions per KV block, a power of two (default {BLOCK_SIZE})")
    g.add_argument("--kv-bits", type=int, choices=(32, 16, 8), default=32,
                   help="32 keeps keys and values exact (default); 16 stores fp16 rows, half the memory (what "
                        "llama.cpp keeps by default); 8 stores int8 rows, a quarter; both with a small error")
    g.add_argument("--overflow", choices=OVERFLOW, default="error",
                   help="past --ctx: stop with an error (default), slide (drop the oldest blocks) or retain (keep "
                        "the first tokens, the recent window and the most attended blocks); both change outputs")


def load_options(args: argparse.Namespace, max_batch: int | None = None, offload: bool | None = None) -> LoadOptions:
    """LoadOptions from the memory, KV and --ctx flags, checked. `offload` None lets the engine service choose
    (a Mixture-of-Experts container is offloaded); the one-shot commands pass whether --max-memory was given."""
    from app.config.sizes import parse_size
    from engine.kv import check_kv_settings

    if not 0 <= args.prefetch_depth <= 1024:    # layers read ahead: more than any model has overflows C sizes
        raise ColibriError(f"--prefetch-depth {args.prefetch_depth}: use 0 (off) to 1024 layers")
    if args.resident_layers is not None and args.resident_layers < 0:
        raise ColibriError(f"--resident-layers {args.resident_layers}: use 0 or more layers")
    if getattr(args, "ctx", None) is not None and args.ctx < 1:
        raise ColibriError(f"--ctx {args.ctx}: the context must hold at least one token")
    check_kv_settings(args.kv_block_size, args.kv_bits, args.overflow)
    return LoadOptions(
        max_memory=parse_size(args.max_memory, "--max-memory") if args.max_memory else None, offload=offload,
        context_length=getattr(args, "ctx", None), prefetch_depth=args.prefetch_depth, io=args.io,
        io_threads=args.io_threads, cache_policy=args.cache_policy, resident_layers=args.resident_layers,
        history=not args.no_history, kv_bits=args.kv_bits, kv_block_size=args.kv_block_size, overflow=args.overflow,
        speculative=getattr(args, "speculative", False) or False, draft=getattr(args, "draft", None),
        **({} if max_batch is None else {"max_batch": max_batch}))
