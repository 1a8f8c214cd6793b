"""Fused checkpoint tensors, cut into the per-matrix tensors the engine reads.

Some checkpoints store several of Colibri's tensors in one: all of a layer's routed experts in a 3-D
tensor (gpt-oss's `experts.gate_up_proj` [E, hidden, 2I] with gate and up interleaved and stored
[in, out]; Granite's `input_linear.weight` [E, 2I, hidden] with gate then up), or q, k and v in one
matrix (Phi-3). A family declares how such a tensor maps to the engine's names with `FusedTensor`
rules; `split_fused` wraps the checkpoint's `TensorSource` so that everything downstream (expected
shapes, resident loading, `colibri convert`, expert streaming) sees ordinary per-expert tensors
(`...experts.{e}.gate_proj.weight` [out, in]) and never the fused one.

Memory stays bounded by one expert: a piece is cut from the stored bytes (a memory-mapped view) and
widened or made contiguous on its own; a float32 piece that is already contiguous stays a view.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

from engine.errors import ModelFormatError
from engine.formats.safetensors_file import FLOAT_DTYPES, to_float32


@dataclass(frozen=True)
class Piece:
    """One tensor cut out of a fused one: a strided range along one axis, optionally transposed.

    `name` is a template: `\\1`, `\\2` ... are the groups of the rule's pattern, `{e}` the expert index.
    The range applies to the tensor of one expert when the rule is per expert (its leading axis dropped).
    """

    name: str
    axis: int = 0
    start: int = 0
    stop: int | None = None          # None: to the end of the axis
    step: int = 1
    transpose: bool = False          # stored [in, out]: give [out, in] (2-D pieces only)

    def index(self, ndim: int) -> tuple:
        """The numpy index of the range in a tensor of `ndim` axes."""
        return tuple(slice(self.start, self.stop, self.step) if a == self.axis else slice(None) for a in range(ndim))

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The piece's shape, cut from a tensor of `shape`."""
        out = list(shape)
        out[self.axis] = len(range(*slice(self.start, self.stop, self.step).indices(shape[self.axis])))
        return tuple(reversed(out)) if self.transpose else tuple(out)


@dataclass(frozen=True)
class FusedTensor:
    """A checkpoint tensor (its name matched in full by `pattern`) that holds the `pieces`.

    With `per_expert`, its leading axis is the routed expert: every piece is cut from each expert's slab,
    one tensor per expert. A rule with one whole piece renames a tensor (Granite's `router.layer.weight`).
    """

    pattern: str
    pieces: tuple[Piece, ...]
    per_expert: bool = False


@runtime_checkable
class StoredSource(Protocol):
    """A tensor source that can show a tensor's stored bytes (safetensors): a piece is then widened alone."""

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (bfloat16 as uint16), a read-only view."""

    def dtype(self, name: str) -> str:
        """The tensor's stored dtype (safetensors spelling)."""


@runtime_checkable
class PackedSource(Protocol):
    """A tensor source some of whose fused tensors are packed in a quantized format (MXFP4): a piece of one is
    cut from the packed bytes (engine/formats/published.py), never widened."""

    def packed(self, name: str):
        """The packed tensor shown as `name` (with a `piece(expert, piece)` method), None if it is not packed."""


class SplitSource:
    """A TensorSource that shows a checkpoint's fused tensors as the pieces its family's rules cut them into."""

    def __init__(self, base, made: dict[str, tuple[str, int | None, Piece]]):
        self.base = base
        self.path = base.path
        self._made = made                          # piece name -> (fused name, expert or None, piece)
        self._fused = {fused for fused, _, _ in made.values()}
        self._last: tuple[str, np.ndarray] | None = None   # the last fused tensor widened whole (no raw access)

    def names(self) -> Iterable[str]:
        """The base's tensors without the fused ones, and the pieces."""
        return [n for n in self.base.names() if n not in self._fused] + list(self._made)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape (a piece's from its fused tensor's, without reading it)."""
        if name not in self._made:
            return tuple(self.base.shape(name))
        fused, expert, piece = self._made[name]
        shape = tuple(self.base.shape(fused))
        return piece.shape(shape[1:] if expert is not None else shape)

    def load(self, name: str):
        """A tensor as float32: a piece is cut from its fused tensor's stored bytes, copied only when its values
        must be widened or are strided; a piece of a packed (MXFP4) tensor is a quantized tensor of its bytes."""
        if name not in self._made:
            return self.base.load(name)
        fused, expert, piece = self._made[name]
        packed = self.base.packed(fused) if isinstance(self.base, PackedSource) else None
        if packed is not None:
            return packed.piece(expert, piece)
        if isinstance(self.base, StoredSource):
            stored, dtype = self.base.raw(fused), self.base.dtype(fused)
        else:
            stored, dtype = self._whole(fused), "F32"
        if dtype not in FLOAT_DTYPES:
            raise ModelFormatError(f"{self.base.location(fused)}: tensor {fused} is {dtype}, expected a floating-point "
                                   "weight; use a float16, bfloat16 or float32 version of the model")
        slab = stored[expert] if expert is not None else stored
        part = slab[piece.index(slab.ndim)]
        if piece.transpose:
            part = part.T
        out = to_float32(part, dtype) if dtype != "F32" else part
        if not out.flags.c_contiguous:
            out = np.ascontiguousarray(out)
        out.flags.writeable = False
        return out

    def location(self, name: str) -> str:
        """The file holding a tensor (a piece: its fused tensor's)."""
        return self.base.location(self._made[name][0] if name in self._made else name)

    def _whole(self, fused: str) -> np.ndarray:
        """A fused tensor as float32, from a source without raw access (kept while its pieces are read in turn)."""
        if self._last is None or self._last[0] != fused:
            self._last = (fused, np.asarray(self.base.load(fused), np.float32))
        return self._last[1]


def split_fused(source, rules: Sequence[FusedTensor]):
    """`source`, or a SplitSource over it when some of its tensors match a rule.

    A piece named like a tensor the checkpoint holds, or a range outside its fused tensor, is refused: the
    checkpoint and its config disagree.
    """
    if not rules:
        return source
    compiled = [(re.compile(r.pattern), r) for r in rules]
    names = set(source.names())
    made: dict[str, tuple[str, int | None, Piece]] = {}
    for name in sorted(names):
        for pattern, rule in compiled:
            m = pattern.fullmatch(name)
            if m is None:
                continue
            shape = tuple(source.shape(name))
            slab = shape[1:] if rule.per_expert else shape
            for piece in rule.pieces:
                _check_piece(source, name, slab, piece)
                target = m.expand(piece.name)
                for e in range(shape[0]) if rule.per_expert else (None,):
                    made[target.replace("{e}", str(e))] = (name, e, piece)
            break
    if not made:
        return source
    clash = sorted(set(made) & names)
    if clash:
        raise ModelFormatError(f"{source.path}: tensor {clash[0]} is stored both on its own and inside a fused tensor; "
                               "the checkpoint is inconsistent: fetch the model again")
    return SplitSource(source, made)


def _check_piece(source, name: str, slab: tuple[int, ...], piece: Piece) -> None:
    """Refuse a piece that does not fit its fused tensor (the config's sizes disagree with the weights)."""
    if piece.axis >= len(slab) or (piece.transpose and len(slab) != 2) or \
            (piece.stop if piece.stop is not None else slab[piece.axis]) > slab[piece.axis] or piece.start < 0:
        raise ModelFormatError(f"{source.location(name)}: tensor {name} of shape {list(slab)} (per expert) cannot hold "
                               f"{piece.name} (axis {piece.axis}, {piece.start}:{piece.stop}:{piece.step}); the weights "
                               "and config.json disagree: use the config.json that came with them")
