"""`colibri bench MODEL`: prompt and decode speed, bytes per token and the RAM roofline (see app.bench.decode)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.commands._common import load
from app.commands._memory import add_memory_arguments, load_options
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
    parser.add_argument("model", metavar="MODEL", nargs="?", help="a model folder, a .gguf file, or a pulled name")
    parser.add_argument("--prompt", type=int, default=None, metavar="N",
                        help="prompt tokens per run (default 128; per chat with --kv batch, default 32)")
    parser.add_argument("--gen", type=int, default=None, metavar="N",
                        help="decode steps per run (default 64; per chat when streaming, and with --kv batch, "
                             "default 32)")
    parser.add_argument("--runs", type=int, default=None, metavar="N",
                        help="timed runs after the warm-up (default 3; of each TTFT with --kv prefix, default 5)")
    parser.add_argument("--threads", type=int, default=2, metavar="N", help="numba and BLAS threads (default 2)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the random prompt (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    g = parser.add_argument_group("streaming (with --max-memory)")
    g.add_argument("--ctx", type=int, default=1024, metavar="N", help="context the KV budget assumes (default 1024)")
    g.add_argument("--chats", type=int, default=8, metavar="N", help="chats in the streaming workload (default 8)")
    g.add_argument("--trace", type=Path, metavar="FILE", help="record the cold run's routing trace to FILE and "
                   "replay it through every policy and Belady's optimum")
    g.add_argument("--replay", type=Path, metavar="FILE", help="only replay a recorded trace (no model run)")
    g.add_argument("--mmap-gen", type=int, default=8, metavar="N",
                   help="decode steps per chat of the page-fault baseline run (default 8; 0 skips it)")
    parser.add_argument("--kv", metavar="PARTS", default=None,
                        help="measure the KV cache instead: any of prefix,batch,blocks,int8,retention (comma-separated) "
                             "or all: TTFT with a cached 800-token system prompt, 1-8 chats batched, attention per "
                             "block size, int8 KV error, recall past the context with --overflow retain vs slide")
    parser.add_argument("--speculative", action="store_true",
                        help="measure speculative decoding instead: answers of a chat prompt that repeats itself and "
                             "of an ordinary one, alone and 4 together, plain against drafting (--gen tokens, --runs)")
    parser.add_argument("--grammar", action="store_true",
                        help="measure structured output instead: --prompts chat prompts asking for JSON, answered "
                             "greedily and batched as free text, json_object and json_schema (--gen tokens each); "
                             "the share of valid JSON of each and the constraint's cost per token")
    parser.add_argument("--prompts", type=int, default=50, metavar="N",
                        help="prompts of the --grammar bench (default 50, at most 50)")
    parser.add_argument("--batch", type=int, default=8, metavar="N",
                        help="answers decoded together by the --grammar bench (default 8)")
    add_memory_arguments(parser)
    parser.set_defaults(func=_run)


def _check(args: argparse.Namespace) -> None:
    for flag, value in (("--prompt", args.prompt), ("--gen", args.gen), ("--runs", args.runs)):
        if value < 1:
            raise ColibriError(f"{flag} {value}: must be at least 1")
    if args.runs > 1000:
        raise ColibriError(f"--runs {args.runs}: at most 1000 runs")


def format_table(r, baseline: int = 0) -> str:
    """The human-readable report of a BenchResult (`baseline`: the process's RSS before loading, 0: not shown)."""
    runs = lambda values: " ".join(f"{v:.1f}" for v in values)  # noqa: E731
    return "\n".join([
        f"{r.model} ({r.architecture}), {r.threads} thread{'s' if r.threads != 1 else ''}, median of {r.runs} runs after a warm-up",
        f"  prompt    {r.prompt_tokens:5d} tokens  {r.prompt_tok_s:9.1f} tok/s   (runs {runs(r.prompt_tok_s_runs)})",
        f"  decode    {r.gen_tokens:5d} tokens  {r.decode_tok_s:9.1f} tok/s   (runs {runs(r.decode_tok_s_runs)})"
        + ("" if r.kv_bits == 32 else f", {r.kv_bits}-bit KV cache"),
        f"  weights   {r.weight_bytes / 1e9:9.3f} GB resident, {r.bytes_per_token / 1e6:.1f} MB read per decoded token",
        f"  bandwidth {r.achieved_gb_s:9.2f} GB/s achieved of {r.ram_gb_s:.2f} GB/s RAM read measured "
        f"= {r.roofline_fraction * 100:.0f}% of the roofline",
        f"  roofline  {r.roofline_decode_tok_s:9.1f} tok/s decode if reading the weights were all it cost",
    ] + ([f"  memory    {r.rss / 1e6:9.0f} MB resident after the runs, for {r.model_bytes / 1e6:.0f} MB on disk"
          + (f" ({baseline / 1e6:.0f} MB before loading)" if baseline else "")] if r.rss else []))


def _defaults(args: argparse.Namespace, prompt: int, gen: int, runs: int) -> None:
    """Fill in --prompt, --gen and --runs where not given: each kind of bench has its own."""
    args.prompt = prompt if args.prompt is None else args.prompt
    args.gen = gen if args.gen is None else args.gen
    args.runs = runs if args.runs is None else args.runs


def _run(args: argparse.Namespace) -> int:
    from app.bench.decode import bench_model, check_threads

    _defaults(args, *((32, 32, 5) if args.kv is not None else (128, 64, 3)))
    if args.replay is not None:
        from app.bench.offload import format_replay, load_trace, replay

        print(format_replay(replay(load_trace(args.replay))))
        return 0
    if args.model is None:
        raise ColibriError("give MODEL (or --replay FILE)")
    if args.kv is not None:
        return _kv(args)
    if args.speculative:
        return _speculative(args)
    if args.grammar:
        return _grammar(args)
    if args.max_memory is not None:
        return _stream(args)
    _check(args)
    check_threads(args.threads)  # before loading anything
    from app.plan.budget import process_rss

    baseline = process_rss()
    loaded = load(args.model, quiet=args.json)
    live = sys.stderr.isatty() and not args.json

    def on_run(done: int, total: int) -> None:
        if live:
            what = "warm-up" if done == 0 else f"run {done}/{total}"
            print(f"\rbench: {what}   ", end="", file=sys.stderr, flush=True)

    result = bench_model(loaded, prompt=args.prompt, gen=args.gen, runs=args.runs, threads=args.threads,
                         seed=args.seed, on_run=on_run, kv_bits=args.kv_bits)
    if live:
        print("\r" + " " * 24 + "\r", end="", file=sys.stderr)
    if args.json:
        print(json.dumps(dict(result.as_dict(), baseline_rss=baseline)))
    else:
        print(format_table(result, baseline))
    return 0


KV_PARTS = ("prefix", "batch", "blocks", "int8", "retention")


def _kv(args: argparse.Namespace) -> int:
    """The KV cache bench (app.bench.kv)."""
    from app.atlas.probes import heldout_text
    from app.bench.decode import thread_limits
    from app.bench.kv import run_kv_bench

    parts = set(KV_PARTS) if args.kv == "all" else {p.strip() for p in args.kv.split(",") if p.strip()}
    unknown = parts - set(KV_PARTS)
    if unknown or not parts:
        raise ColibriError(f"--kv {args.kv}: use all or any of {','.join(KV_PARTS)}")
    _check(args)
    loaded = load(args.model, quiet=args.json, options=load_options(args))
    log = (lambda m: None) if args.json else (lambda m: print(m, flush=True))
    try:
        with thread_limits(args.threads):
            report = run_kv_bench(loaded, parts, heldout_text(), log=log, prompt=args.prompt, gen=args.gen,
                                  runs=args.runs)
    finally:
        loaded.close()
    if args.json:
        import dataclasses

        print(json.dumps(dataclasses.asdict(report)))
    return 0


def _speculative(args: argparse.Namespace) -> int:
    """The speculative decoding bench (app.bench.speculative)."""
    from app.bench.decode import check_threads, thread_limits
    from app.bench.speculative import run_speculative_bench

    _check(args)
    check_threads(args.threads)
    loaded = load(args.model, quiet=args.json, options=load_options(args))
    log = (lambda m: None) if args.json else (lambda m: print(m, flush=True))
    try:
        with thread_limits(args.threads):
            cases = run_speculative_bench(loaded, gen=args.gen, runs=args.runs, log=log)
    finally:
        loaded.close()
    if args.json:
        print(json.dumps({name: {"plain_tok_s": c.plain, "drafting_tok_s": c.drafting, "ratio": round(c.ratio, 3),
                                 "drafted": c.drafted, "accepted": c.accepted, "identical": c.identical}
                          for name, c in cases.items()}))
    return 0


def _grammar(args: argparse.Namespace) -> int:
    """The structured output bench (app.bench.grammar)."""
    from app.bench.decode import check_threads, thread_limits
    from app.bench.grammar import prompts, run_grammar_bench

    _check(args)
    if args.batch < 1:
        raise ColibriError(f"--batch {args.batch}: must be at least 1")
    prompts(args.prompts)   # refuses a bad count before loading anything
    check_threads(args.threads)
    loaded = load(args.model, quiet=args.json, options=load_options(args))
    log = (lambda m: None) if args.json else (lambda m: print(m, flush=True))
    try:
        with thread_limits(args.threads):
            results = run_grammar_bench(loaded, n_prompts=args.prompts, gen=args.gen, batch=args.batch, log=log)
    finally:
        loaded.close()
    if args.json:
        print(json.dumps({mode: r.as_dict() for mode, r in results.items()}))
    return 0


def _stream(args: argparse.Namespace) -> int:
    """The streaming bench: cold, warm (learned pins) and page-fault runs against the I/O roofline; for a dense
    container, cold and warm runs with its layers streamed."""
    import dataclasses
    import tempfile

    from app.bench.decode import check_threads, thread_limits
    from app.bench.offload import (
        DISK_REPEATS,
        disk_bandwidth,
        format_replay,
        format_runs,
        replay,
        resident_decode,
        run_workload,
        save_trace,
        workload,
    )
    from app.commands._common import budget_plan, streamable
    from app.hub.pull import resolve_model
    from app.plan.budget import process_rss
    from engine.loader import open_checkpoint
    from engine.offload.io import PAGE, round_up

    if args.chats < 1 or args.gen < 1:
        raise ColibriError("--chats and --gen must be at least 1")
    check_threads(args.threads)
    log = (lambda m: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    options = dataclasses.replace(load_options(args), history=False)
    path = streamable(resolve_model(args.model), options, quiet=args.json)
    base = budget_plan(path, options, quiet=args.json).offload
    # the interpreter's and libraries' footprint once the engine is imported, before any weights load: what
    # `run` reports beside the budget (measured earlier, it would leave out numba's and the engine's imports)
    baseline = process_rss()
    ckpt = open_checkpoint(path, verify=False)
    c = ckpt.source
    if not getattr(c, "extents", None):
        return _stream_layers(args, path, base, baseline, ckpt, log)
    slot = round_up(max(x.length for x in c.extents.values()), PAGE)
    prompts = workload(ckpt.tokenizer, args.chats, ckpt.spec.vocab_size)
    gb_s = disk_bandwidth(path, slot, args.io_threads)
    log(f"disk: {gb_s:.2f} GB/s cold reads of {slot / 1e6:.2f} MB on {args.io_threads} threads (the best of "
        f"{DISK_REPEATS})")
    trace: list = []
    runs = []
    with tempfile.TemporaryDirectory() as tmp, thread_limits(args.threads):
        history = Path(tmp) / "usage.npz"
        learn = dataclasses.replace(base, history_path=history)
        runs.append(run_workload(path, learn, prompts, args.gen, "cold", gb_s, trace, log))
        runs.append(run_workload(path, learn, prompts, args.gen, "warm", gb_s, None, log))
        if args.mmap_gen > 0 and base.store.io != "mmap":
            mm = dataclasses.replace(base, store=dataclasses.replace(base.store, io="mmap"))
            runs.append(run_workload(path, mm, prompts, args.mmap_gen, "mmap", gb_s, None, log))
        resident = resident_decode(path, prompts, args.gen, log)
    moe = [layer.ffn for layer in ckpt.spec.layers if hasattr(layer.ffn, "n_experts")]
    data = {"model_hash": c.model_hash, "n_layers": ckpt.spec.n_layers, "n_experts": max(m.n_experts for m in moe),
            "chats": trace}
    rows = replay(data) if len(trace) >= 2 else []
    if args.trace is not None:
        save_trace(args.trace, data["model_hash"], data["n_layers"], data["n_experts"], trace)
    if args.json:
        print(json.dumps({"baseline_rss": baseline, "budget": base.store.capacity, "disk_gb_s": gb_s,
                          "resident_decode_tok_s": resident, "runs": [r.as_dict() for r in runs],
                          "replay": [dataclasses.asdict(r) for r in rows]}))
    else:
        print(f"{path.name}: expert cache {base.store.capacity / 1e6:.0f} MB, {args.chats} chats x {args.gen} tokens; "
              f"interpreter and libraries {baseline / 1e6:.0f} MB before loading")
        print(format_runs(runs, resident))
        if rows:
            print("routing trace replayed (prior: first half of the chats; scored: second half)")
            print(format_replay(rows))
    return 0


LAYER_READ_BLOCK = 64 << 20    # the disk measured in reads this large: a streamed layer is read a run at a time


def _stream_layers(args: argparse.Namespace, path: Path, base, baseline: int, ckpt, log) -> int:
    """A dense container under a budget: cold and warm runs with its layers streamed, against the I/O roofline
    (the disk bandwidth over the bytes a token reads), and the resident run where the machine holds the weights."""
    from app.bench.decode import thread_limits
    from app.bench.offload import (
        DISK_REPEATS,
        disk_bandwidth,
        format_layer_runs,
        resident_decode,
        run_layer_workload,
        workload,
    )

    if ckpt.spec.n_layers <= base.resident_layers:
        raise ColibriError(f"{path.name}: --max-memory holds all {ckpt.spec.n_layers} layers, none is streamed; "
                           "give a smaller --max-memory (or --resident-layers) to measure streaming, or drop "
                           "--max-memory for the resident bench")
    prompts = workload(ckpt.tokenizer, args.chats, ckpt.spec.vocab_size)
    gb_s = disk_bandwidth(path, LAYER_READ_BLOCK, args.io_threads)
    log(f"disk: {gb_s:.2f} GB/s cold reads of {LAYER_READ_BLOCK >> 20} MB on {args.io_threads} threads (the best "
        f"of {DISK_REPEATS})")
    with thread_limits(args.threads):
        runs = [run_layer_workload(path, base, prompts, args.gen, "cold", gb_s, cold=True, log=log),
                run_layer_workload(path, base, prompts, args.gen, "warm", gb_s, cold=False, log=log)]
        resident = resident_decode(path, prompts, args.gen, log)
    if args.json:
        print(json.dumps({"baseline_rss": baseline, "budget": base.store.capacity, "disk_gb_s": gb_s,
                          "resident_decode_tok_s": resident, "runs": [r.as_dict() for r in runs]}))
    else:
        print(f"{path.name}: dense, {runs[0].streamed_layers} of {ckpt.spec.n_layers} layers streamed, "
              f"{args.chats} chats x {args.gen} tokens; interpreter and libraries {baseline / 1e6:.0f} MB before "
              "loading")
        if resident:
            print(f"  resident (every weight in memory): decode {resident:6.2f} tok/s")
        print(format_layer_runs(runs))
    return 0
