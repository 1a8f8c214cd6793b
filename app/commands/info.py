"""`colibri info OUT`: a container's manifest as a readable table (or what a GGUF file's metadata says);
`--verify` checks every checksum of a container."""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `info` command."""
    parser = subparsers.add_parser("info", help="show a Colibri container's manifest (or a GGUF file's model)",
                                   description="Print a container's format, hash, plan and tensors; routed experts "
                                   "are summarised per layer unless --all is given. A .gguf file shows its "
                                   "model and tensors.")
    parser.add_argument("path", metavar="OUT", type=Path,
                        help="a container folder written by `colibri convert`, or a .gguf file")
    parser.add_argument("--all", action="store_true", help="list every tensor, experts included")
    parser.add_argument("--verify", action="store_true",
                        help="check every tensor's and expert extent's checksum (exit 2 at the first damaged one)")
    parser.set_defaults(func=_run)


def _fmt(entry) -> str:
    if entry.kind == "quant":
        return f"int{entry.quant.get('bits')} g{entry.quant.get('group')}"
    return entry.kind


def _run(args: argparse.Namespace) -> int:
    from app.config.sizes import format_size
    from engine.errors import ColibriError
    from engine.formats.container import Container

    path: Path = args.path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ColibriError(f"{path}: not a Colibri container nor a .gguf file; pass a folder written by "
                               "`colibri convert`, or a GGUF file")
        if args.verify:
            raise ColibriError(f"{path}: a GGUF file carries no checksums to verify; --verify checks a container")
        return _gguf(path, args.all)
    c = Container.open(path, verify=False)
    if args.verify:
        c.verify()              # every tensor, experts included; a ModelFormatError names the first damaged one
        c.verify_extents()
        checked = sum(e.length for e in c.entries.values())
        print(f"verify      ok: {len(c.entries)} tensors and {len(c.extents)} expert extents "
              f"({format_size(checked)}) match their checksums")
        return 0
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


def _gguf(path: Path, show_all: bool) -> int:
    """What a GGUF file's metadata and tensor table say, without reading its weights."""
    from app.config.sizes import format_size
    from engine.formats.gguf_model import GGUFModel
    from engine.models import spec_from_config

    g = GGUFModel(path)
    spec = spec_from_config(g.config, f"{path} (GGUF metadata)")
    tensors = g.reader.tensors
    meta = g.meta
    print(f"gguf        {path}  ({meta.get('general.name', '?')})")
    print(f"model       {spec.architecture}: {spec.n_layers} layers, hidden {spec.hidden_size}, "
          f"vocabulary {spec.vocab_size}" + (", mixture of experts" if spec.is_moe else ""))
    print(f"tensors     {len(tensors)}, {format_size(sum(int(t.n_bytes) for t in tensors))}")
    print()
    rows = [(t.name, t.tensor_type.name, "x".join(str(int(d)) for d in reversed(t.shape)), format_size(int(t.n_bytes)))
            for t in tensors]
    if not show_all:            # one row per kind of layer tensor: blk.N.attn_q.weight ...
        kinds: dict[str, tuple] = {}
        for name, fmt, shape, size in rows:
            kinds.setdefault(re.sub(r"^blk\.\d+\.", "blk.*.", name), (fmt, shape, size))
        rows = [(name, *rest) for name, rest in kinds.items()]
    header = ("tensor", "format", "shape", "bytes")
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(4)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for r in sorted(rows, key=lambda r: _natural(r[0])):
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    return 0


def _natural(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]
