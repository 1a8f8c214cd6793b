"""The shape of a container's manifest.json, checked before anything reads it.

A small explicit validator rather than a schema library: engine/ stays light (jsonschema is not a
dependency, pydantic comes with the server only), and each check says in the user's terms what is
wrong. Every failure is a ModelFormatError ending in "the container is corrupt: convert the model
again", so an edited or damaged manifest never ends in a KeyError deep inside a load.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ModelFormatError
from engine.kernels.layout import BITS, GROUPS

FIX = "the container is corrupt: convert the model again with `colibri convert`"
PLAIN_KINDS = {"f32": 4, "f16": 2, "bf16": 2}                   # kind -> bytes per value
_ENTRY_KEYS = {"name", "kind", "shape", "file", "offset", "length", "crc32"}
_QUANT_KEYS = {"kind", "version", "layout", "shape", "bits", "group", "asymmetric"}
# weights kept as published: FP8 / MXFP4, and GGUF K-quant / IQ4 blocks
_PUBLISHED = ("colibri.fp8", "colibri.mxfp4", "colibri.kquant")
_PUBLISHED_KEYS = {"kind", "version", "shape", "bits", "group"}
_EXTENT_KEYS = {"layer", "expert", "file", "offset", "length", "crc32", "tensors"}
_BUFFER_DTYPES = {"|u1", "<u2", "<f4", "<f2", "|i1"}          # what quantized tensors store
_ITEMSIZE = {d: np.dtype(d).itemsize for d in _BUFFER_DTYPES}


class _Bad(Exception):
    """One problem found in the manifest (turned into a ModelFormatError naming the file)."""


def corrupt(path: str | Path, what: str) -> ModelFormatError:
    """The error for a damaged container: what is wrong, and the fix."""
    return ModelFormatError(f"{path}: {what}; {FIX}")


def check_manifest(manifest: Any, path: str | Path) -> None:
    """Raise a ModelFormatError unless `manifest` has the shape a container's manifest has (versions 1 and 2)."""
    try:
        _check(manifest)
    except _Bad as exc:
        raise corrupt(path, str(exc)) from None


def _count(value: Any, what: str, field: str = "") -> int:
    """A non-negative JSON integer (bools and floats refused)."""
    if type(value) is not int or value < 0:   # exactly int: bool is a subclass
        raise _Bad(f"{what}{field} is {value!r:.60}, expected a non-negative integer")
    return value


def _shape(value: Any, what: str, field: str = "") -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise _Bad(f"{what}{field} is {value!r:.60}, expected a list of sizes")
    return tuple(_count(d, what, field) for d in value)


def _keys(d: Any, required: set[str], optional: set[str], what: str) -> dict:
    if not isinstance(d, dict):
        raise _Bad(f"{what} is a JSON {type(d).__name__}, expected an object")
    missing, unknown = required - d.keys(), d.keys() - required - optional
    if missing:
        raise _Bad(f"{what} lacks {', '.join(sorted(missing))}")
    if unknown:
        raise _Bad(f"{what} has unknown key(s) {', '.join(map(repr, sorted(unknown)))}")
    return d


def _file(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _plain_name(value):
        raise _Bad(f"{what} names file {value!r:.60}, expected a file of the container")
    return value


@functools.lru_cache(maxsize=256)
def _plain_name(name: str) -> bool:
    """A bare file name inside the container: a path elsewhere would map another file."""
    return bool(name) and Path(name).name == name and not name.startswith(".")


def _check(m: Any) -> None:
    if not isinstance(m, dict):
        raise _Bad(f"the manifest is a JSON {type(m).__name__}, expected an object")
    for key, kind in (("model_hash", str), ("config", dict), ("tensors", dict)):
        if not isinstance(m.get(key), kind):
            raise _Bad(f"{key!r} is {m.get(key)!r:.60}, expected a JSON {'string' if kind is str else 'object'}")
    for key in ("source", "plan"):
        if key in m and not isinstance(m[key], dict):
            raise _Bad(f"{key!r} is {m[key]!r:.60}, expected a JSON object")
    if not isinstance(m.get("experts", []), list):
        raise _Bad("'experts' is not a list")
    for name, e in m["tensors"].items():
        _check_entry(name, e)
    seen: set[tuple[int, int]] = set()
    for i, x in enumerate(m.get("experts", [])):
        _check_extent(i, x, m["tensors"], seen)


def _check_entry(name: str, e: Any) -> None:
    what = f"tensor {name}"
    kind = e.get("kind") if isinstance(e, dict) else None
    if isinstance(e, dict) and kind not in (*PLAIN_KINDS, "quant"):
        raise _Bad(f"{what} has kind {kind!r}, expected one of {', '.join([*PLAIN_KINDS, 'quant'])}")
    quant = kind == "quant"
    _keys(e, _ENTRY_KEYS | ({"quant", "buffers"} if quant else set()), set(), what)
    if e["name"] != name:
        raise _Bad(f"{what} is listed under the name {e['name']!r}")
    shape = _shape(e["shape"], what, ": shape")
    _file(e["file"], what)
    _count(e["offset"], what, ": offset")
    length = _count(e["length"], what, ": length")
    if _count(e["crc32"], what, ": crc32") >= 1 << 32:
        raise _Bad(f"{what}: crc32 {e['crc32']} is not a 32-bit checksum")
    if e["kind"] in PLAIN_KINDS:
        need = math.prod(shape) * PLAIN_KINDS[e["kind"]]
        if length != need:
            raise _Bad(f"{what}: {e['kind']} {list(shape)} needs {need} bytes, the manifest says {length}")
    else:
        _check_quant(what, shape, e["quant"])
        _check_buffers(what, length, e["buffers"])


def _check_published(what: str, shape: tuple[int, ...], q: dict) -> None:
    """FP8 / MXFP4 weights kept as published (engine/quant/published.py): shape, width and FP8 block."""
    if q["kind"] == "colibri.kquant":
        _check_kquant(what, shape, q)
        return
    fp8 = q["kind"] == "colibri.fp8"
    _keys(q, _PUBLISHED_KEYS | ({"block"} if fp8 else set()), set(), f"{what}: quant")
    if len(shape) != 2 or _shape(q["shape"], what, ": quant shape") != shape:
        raise _Bad(f"{what}: quantized shape {q['shape']!r} does not match the tensor's {list(shape)}")
    if q["bits"] != (8 if fp8 else 4) or isinstance(q["bits"], bool):
        raise _Bad(f"{what}: bits {q['bits']!r} is not the width of {q['kind']}")
    if fp8:
        _shape(q["block"], what, ": FP8 block")
        if len(q["block"]) != 2 or 0 in q["block"]:
            raise _Bad(f"{what}: FP8 block {q['block']!r} is not two positive sizes")
    elif shape[1] % 32:
        raise _Bad(f"{what}: an MXFP4 matrix of {shape[1]} columns is not in whole 32s")


def _check_kquant(what: str, shape: tuple[int, ...], q: dict) -> None:
    """GGUF K-quant / IQ4 blocks kept as published (engine/quant/kquant.py): shape, type, its width and block."""
    from engine.kernels.kquant import BLOCK_WEIGHTS
    from engine.quant.kquant import KINDS, NOMINAL_BITS

    _keys(q, _PUBLISHED_KEYS | {"type"}, {"layout"}, f"{what}: quant")
    if len(shape) != 2 or _shape(q["shape"], what, ": quant shape") != shape:
        raise _Bad(f"{what}: quantized shape {q['shape']!r} does not match the tensor's {list(shape)}")
    qtype = next((t for t in KINDS if t.name == q["type"]), None)
    if qtype is None:
        raise _Bad(f"{what}: type {q['type']!r:.60} is not a K-quant or IQ4 type")
    if "layout" in q and (q["layout"] != "rows16-v1" or qtype.name not in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS") or shape[0] % 16):
        raise _Bad(f"{what}: layout {q['layout']!r:.60} is not one a {q['type']} [{shape[0]}, ...] matrix takes")
    if q["bits"] != NOMINAL_BITS[qtype] or q["group"] != BLOCK_WEIGHTS[KINDS[qtype]] or shape[1] % q["group"]:
        raise _Bad(f"{what}: bits {q['bits']!r} and group {q['group']!r} are not those of {q['type']} over "
                   f"{shape[1]} columns")


def _check_quant(what: str, shape: tuple[int, ...], q: Any) -> None:
    if isinstance(q, dict) and q.get("kind") in _PUBLISHED:
        _check_published(what, shape, q)
        return
    _keys(q, _QUANT_KEYS, set(), f"{what}: quant")
    if len(shape) != 2 or _shape(q["shape"], what, ": quant shape") != shape:
        raise _Bad(f"{what}: quantized shape {q['shape']!r} does not match the tensor's {list(shape)}")
    if q["bits"] not in BITS or isinstance(q["bits"], bool):
        raise _Bad(f"{what}: bits {q['bits']!r} is not one of {', '.join(map(str, BITS))}")
    if q["group"] not in GROUPS or isinstance(q["group"], bool):
        raise _Bad(f"{what}: group {q['group']!r} is not one of {', '.join(map(str, GROUPS))}")
    if not isinstance(q["asymmetric"], bool):
        raise _Bad(f"{what}: asymmetric is {q['asymmetric']!r}, expected true or false")


def _check_buffers(what: str, length: int, buffers: Any) -> None:
    if not isinstance(buffers, dict) or not buffers:
        raise _Bad(f"{what}: buffers is {buffers!r:.60}, expected an object")
    for key, b in buffers.items():
        where = f"{what}: buffer {key!r}"
        if not isinstance(b, list) or len(b) != 4:
            raise _Bad(f"{where} is {b!r:.60}, expected [offset, bytes, dtype, shape]")
        off, nbytes, dtype, shape = b
        _count(off, where, " offset")
        _count(nbytes, where, " bytes")
        if not isinstance(dtype, str) or dtype not in _BUFFER_DTYPES:
            raise _Bad(f"{where} has dtype {dtype!r:.60}")
        if math.prod(_shape(shape, where, " shape")) * _ITEMSIZE[dtype] != nbytes:
            raise _Bad(f"{where}: {nbytes} bytes do not hold {dtype} {shape}")
        if off + nbytes > length:
            raise _Bad(f"{where} ends at byte {off + nbytes} of a {length}-byte span")


def _check_extent(i: int, x: Any, tensors: dict, seen: set[tuple[int, int]]) -> None:
    what = f"expert extent {i}"
    _keys(x, _EXTENT_KEYS, set(), what)
    key = (_count(x["layer"], what, ": layer"), _count(x["expert"], what, ": expert"))
    if key in seen:
        raise _Bad(f"{what}: layer {key[0]} expert {key[1]} is listed twice")
    seen.add(key)
    fname = _file(x["file"], what)
    start, length = _count(x["offset"], what, ": offset"), _count(x["length"], what, ": length")
    if _count(x["crc32"], what, ": crc32") >= 1 << 32:
        raise _Bad(f"{what}: crc32 {x['crc32']} is not a 32-bit checksum")
    if not isinstance(x["tensors"], list) or not x["tensors"]:
        raise _Bad(f"{what}: tensors is {x['tensors']!r:.60}, expected a list of names")
    for name in x["tensors"]:
        e = tensors.get(name) if isinstance(name, str) else None
        if e is None:
            raise _Bad(f"{what} lists tensor {name!r}, which the manifest does not describe")
        if e["file"] != fname or not start <= e["offset"] <= e["offset"] + e["length"] <= start + length:
            raise _Bad(f"{what}: tensor {name} lies outside the extent")
