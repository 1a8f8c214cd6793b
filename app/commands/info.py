"""`colibri info OUT`: a container's manifest as a readable table."""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `info` command."""
    parser = subparsers.add_parser("info", help="show a Colibri container's manifest",
                                   description="Print a container's format, hash, plan and tensors; routed experts "
                                   "are summarised per layer unless --all is given.")
    parser.add_argument("path", metavar="OUT", type=Path, help="a container folder written by `colibri convert`")
    parser.add_argument("--all", action="store_true", help="list every tensor, experts included")
    parser.set_defaults(func=_run)


def _fmt(entry) -> str:
    if entry.kind == "quant":
        return f"int{entry.quant.get('bits')} g{entry.quant.get('group')}"
    return entry.kind


def _run(args: argparse.Namespace) -> int:
    from app.config.sizes import format_size
    from engine.formats.container import Container

    c = Container.open(args.path, verify=False)
    m = c.manifest
    total = sum(e.length for e in c.entries.values())
    print(f"container   {args.path}  (format {m['format']} v{m['version']})")
    print(f"model hash  {c.model_hash}")
    print(f"source      {m.get('source', {}).get('path', '?')}  ({m.get('source', {}).get('architecture', '?')})")
    plan = m.get("plan", {})
    budget = plan.get("budget")
    print(f"plan        {plan.get('bits_per_weight', 0):.2f} bits per weight"
          + (f", budget {format_size(budget)}" if budget else ", uniform")
          + f"; {format_size(total)} of weights, {len(c.extents)} expert extents")
    print()
    rows = []
    expert_re = re.compile(r"(model\.layers\.\d+\.\w+\.experts)\.\d+\.(\w+)\.weight")
    grouped: dict[tuple[str, str], list] = defaultdict(list)
    for name, e in c.entries.items():
        m_ = expert_re.fullmatch(name)
        if m_ and not args.all:
            grouped[(m_.group(1), m_.group(2))].append(e)
            continue
        rows.append((name, _fmt(e), "x".join(map(str, e.shape)), format_size(e.length), e.file))
    for (prefix, proj), entries in sorted(grouped.items()):
        kinds = defaultdict(int)
        for e in entries:
            kinds[_fmt(e)] += 1
        mix = ", ".join(f"{n}x {k}" for k, n in sorted(kinds.items()))
        rows.append((f"{prefix}.*.{proj}", mix, "x".join(map(str, entries[0].shape)),
                     format_size(sum(e.length for e in entries)), entries[0].file))
    widths = [max(len(r[i]) for r in rows + [("tensor", "format", "shape", "bytes", "file")]) for i in range(5)]
    header = ("tensor", "format", "shape", "bytes", "file")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for r in sorted(rows, key=lambda r: _natural(r[0])):
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    return 0


def _natural(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]
