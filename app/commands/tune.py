"""`colibri tune MODEL`: measure the settings that change speed but never output, and keep the fastest in the
model's colibri.toml (app.bench.tune has the search and its noise rule, app.config.tuned the file's section)."""

from __future__ import annotations

import argparse
import json
import sys

from app.bench.tune import K_SPREAD, MIN_GAIN, REPEATS
from engine.errors import ColibriError

DESCRIPTION = (
    "Measure, on this machine, the settings of `colibri run` that change speed but never the answer (with "
    "--max-memory: prefetch depth, reader threads, cache policy; always: compute threads, KV block size, "
    "speculative decoding and its draft length) on one workload: a fixed question answered with --gen greedy "
    "tokens. The current settings run first; their token ids are the reference, and a candidate whose output "
    "differs by one token is rejected and reported (a bug of the engine). One setting is tried at a time, each "
    "value against the current settings in --repeats alternating runs a side. A candidate is accepted only when "
    f"the median of its times beats the current median by more than {K_SPREAD:g} pooled spreads (median absolute "
    f"deviations scaled to a standard deviation) and by at least {MIN_GAIN * 100:g}%; the winner must pass the "
    "same rule against the starting settings at the end. The search stops starting comparisons before "
    "--budget-seconds. The winner goes into a [tuned] table of the model's colibri.toml (beside a .gguf or in the "
    "model folder; other lines kept) with a fingerprint of machine, model and budget: where the fingerprint no "
    "longer matches, run, chat, serve and gui ignore the values (saying so) until `colibri tune` runs again. A "
    "setting you chose yourself (a flag, a variable, --config or the model file's own keys) is left as it is.")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `tune` command."""
    from app.commands._memory import size_text
    from app.config.settings import PROFILES

    parser = subparsers.add_parser("tune", help="find the fastest speed-only settings for a model on this machine",
                                   description=DESCRIPTION)
    parser.add_argument("model", metavar="MODEL", help="a model folder, a .gguf file, or a pulled name")
    parser.add_argument("--max-memory", metavar="SIZE", type=size_text,
                        help="tune for runs under this memory budget (streaming; needs a container)")
    parser.add_argument("--ctx", type=int, default=None, metavar="N", help="context length of the runs tuned for")
    parser.add_argument("--kv-bits", type=int, choices=(32, 16, 8), default=None,
                        help="KV cache bits of the runs tuned for (it changes output, so it is never tuned)")
    parser.add_argument("--config", metavar="FILE", help="a settings file, as run's --config")
    parser.add_argument("--profile", choices=tuple(PROFILES), default=None, help="a profile, as run's --profile")
    parser.add_argument("--budget-seconds", type=float, default=600.0, metavar="S",
                        help="time for the whole search (default 600); comparisons that would pass it are skipped")
    parser.add_argument("--gen", type=int, default=32, metavar="N", help="greedy tokens a run generates (default 32)")
    parser.add_argument("--repeats", type=int, default=REPEATS, metavar="N",
                        help=f"timed runs of each side per comparison (default {REPEATS})")
    parser.add_argument("--dry-run", action="store_true", help="print the result without writing colibri.toml")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.set_defaults(func=_run)


def run_settings(args: argparse.Namespace, path):
    """What `colibri run MODEL` would use with tune's --max-memory, --ctx, --kv-bits, --config, --profile."""
    from app.cli import build_parser
    from app.config import settings

    argv = ["run", str(path), "--prompt", "tune"]
    for flag, value in (("--max-memory", args.max_memory), ("--ctx", args.ctx), ("--kv-bits", args.kv_bits),
                        ("--config", args.config), ("--profile", args.profile)):
        if value is not None:
            argv += [flag, str(value)]
    parser = build_parser()
    parsers = settings.command_parsers(parser)
    ns = parser.parse_args(argv)
    return settings.resolve("run", parsers, ns, settings.explicit_dests(parser, argv, parsers["run"]))


def _chosen_by_user(source: str) -> bool:
    return not (source == "default" or source.startswith("profile:") or source.endswith("[tuned]"))


def _run(args: argparse.Namespace) -> int:
    import numba

    from app.bench.tune import tune
    from app.bench.tune_model import ModelBench, axes_for, start_settings
    from app.config import tuned
    from app.config.settings import model_file, physical_cores
    from app.config.sizes import parse_size
    from app.hub.pull import resolve_model
    from app.service.model import n_experts
    from engine.loader import open_checkpoint

    if args.gen < 1 or args.budget_seconds <= 0:
        raise ColibriError("--gen and --budget-seconds must be positive")
    path = resolve_model(args.model)
    log = (lambda m: None) if args.json else (lambda m: print(f"tune: {m}", file=sys.stderr, flush=True))
    resolved = run_settings(args, path)
    for notice in resolved.notices:
        print(f"colibri: {notice}", file=sys.stderr)
    merged = {k: s.value for k, s in resolved.settings.items()}
    start = start_settings(merged)
    streaming = bool(start.get("max_memory"))
    experts = n_experts(open_checkpoint(path, verify=False).spec) > 0
    fixed = sorted(k for k, s in resolved.settings.items() if _chosen_by_user(s.source))
    if start.get("speculative") == "mtp":
        fixed += ["speculative", "draft"]
    axes = [a for a in axes_for(streaming, experts, min(physical_cores(), numba.config.NUMBA_NUM_THREADS))
            if a.key not in fixed]
    tunable = {a.key for a in axes_for(True, True, 2)}
    kept = [k for k in fixed if k in tunable]
    log(f"{path.name}: tuning {', '.join(a.key for a in axes)}"
        + (f"; left as you set them: {', '.join(kept)}" if kept else "") + f"; budget {args.budget_seconds:g} s")
    bench = ModelBench(path, args.gen)
    try:
        result = tune(bench, start, axes, repeats=args.repeats, budget_seconds=args.budget_seconds, log=log,
                      fixed=fixed)
    finally:
        bench.close()
    measured = {o.key for o in result.outcomes if o.status in ("accepted", "not faster")}
    values = {a.key: result.chosen[a.key] for a in axes if a.key in measured}
    target = model_file(str(path))
    budget = parse_size(start["max_memory"], "--max-memory") if streaming else None
    fp = tuned.fingerprint(path, budget)
    written = False
    if values and target is not None and not args.dry_run:
        tuned.write(target, values, fp)
        written = True
    _report(args, result, values, target, written, fp, len(bench.prompt or ()))
    return 0


def _report(args, result, values, target, written: bool, fp, prompt_tokens: int) -> None:
    if args.json:
        import dataclasses

        print(json.dumps({"start": _plain(result.start), "chosen": _plain(result.chosen),
                          "changed": _plain(result.changed), "written": values if written else {},
                          "file": str(target) if target else None, "fingerprint": fp,
                          "final": dataclasses.asdict(result.final) if result.final else None,
                          "outcomes": [{**dataclasses.asdict(o)} for o in result.outcomes],
                          "rejected": len(result.rejected), "seconds": result.seconds,
                          "prompt_tokens": prompt_tokens, "gen": args.gen}))
        return
    print(f"workload: a {prompt_tokens}-token prompt and {args.gen} greedy tokens; {result.seconds:.0f} s of tuning")
    for o in result.outcomes:
        v = o.verdict
        figures = f"{v.base_median:.3f} s -> {v.cand_median:.3f} s, {v.reason}" if v else o.detail
        print(f"  {f'{o.key} = {o.value}':24} {o.status:14} {figures}")
    for o in result.rejected:
        print(f"ENGINE BUG: {o.key} = {o.value} changed the greedy output ({o.detail}); it was rejected. Please "
              "report it: a speed setting must never change the answer.")
    if result.changed and result.final is not None:
        f = result.final
        print(f"chosen: {', '.join(f'{k} = {v}' for k, v in result.changed.items())}: {f.base_median:.3f} s -> "
              f"{f.cand_median:.3f} s a run ({f.base_median / f.cand_median:.2f}x, "
              f"{args.gen / f.base_median:.1f} -> {args.gen / f.cand_median:.1f} generated tok/s)")
    elif result.final is not None:
        print(f"nothing kept: the chosen settings did not beat the starting ones in the final check "
              f"({result.final.reason})")
    elif any(o.status in ("accepted", "not faster") for o in result.outcomes):
        print("nothing beat the current settings beyond the noise")
    else:
        print(f"no comparison fitted in --budget-seconds {args.budget_seconds:g} (a run takes up to "
              f"{result.run_seconds:.1f} s, a comparison {2 * args.repeats} runs, and one is kept for the final "
              "check): give more time")
    if written:
        print(f"wrote [tuned] {', '.join(f'{k} = {v}' for k, v in values.items())} to {target}")
    elif args.dry_run and values:
        print(f"--dry-run: {target} left as it was")


def _plain(d):
    return {k: (str(v) if not isinstance(v, (int, float, str, bool, type(None), list)) else v) for k, v in d.items()}
