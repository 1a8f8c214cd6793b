"""The bit planner: given a byte budget, choose each weight matrix's bit width to lose the least.

A matrix quantized to b bits perturbs its output by E||(W - Q_b(W)) x||^2 per token that reaches
it; with the calibration's input energy E[x_c^2] this is sum_c E[x_c^2] * sum_r dW[r, c]^2 (the
importance-weighted error), and times the share of tokens that use the matrix (routed experts
used more often weigh more). Errors are measured, not guessed from names: each matrix is
quantized at every candidate width (on a sample of its rows, the error summed as the codes are
found, without storing them), and widths are handed
out by marginal error reduction per byte until the budget is spent.

Each matrix is offered every storage format: width, group size (scales per 32, 64 or 128
weights) and, at 4 bits and below, zero points; a format's bytes include its scales. Errors of
different matrices are in different units (an error in the output head is in logits, one inside
the network is amplified by the layers after it): `engine/plan/sensitivity.py` measures a scale per
matrix that turns its error into output KL, and `scaled` applies it before the allocation.
"""

from __future__ import annotations

import fnmatch
import functools
import heapq
from dataclasses import asdict, dataclass, replace
from typing import Iterable, Mapping

import numpy as np

from engine.errors import ColibriError

BIT_OPTIONS = (2, 3, 4, 5, 6, 8)
GROUP_OPTIONS = (32, 64, 128)
ZERO_POINT_BITS = 4          # widths up to this one are offered with zero points too
FLOAT_BITS = 32              # "keep this matrix in float32"
SAMPLE_ROWS = 256            # rows measured per matrix and width (the error is scaled to all rows)


@dataclass(frozen=True)
class Format:
    """A storage format for one matrix: width, weights per scale, stored zero points."""

    bits: int
    group: int
    asymmetric: bool


@dataclass(frozen=True)
class Option:
    """One way to store a matrix: its format, its bytes, the output error it causes."""

    bits: int
    nbytes: int
    error: float
    group: int = 0            # 0: not quantized (float32), or a test's bare option
    asymmetric: bool = False


@dataclass(frozen=True)
class TensorPlan:
    """The width chosen for one matrix."""

    name: str
    shape: tuple[int, int]
    bits: int                 # 2..8, or 32 for float32
    group: int
    nbytes: int
    error: float              # planner units: output KL when calibrated, else weighted error
    usage: float              # share of tokens that reach it
    asymmetric: bool | None = None  # zero points stored per group (None: the width's default)
    sensitivity: float = 1.0  # KL per unit of weighted error (1: not calibrated)


@dataclass(frozen=True)
class Plan:
    """Every quantizable matrix's width, and the bytes it all takes."""

    tensors: dict[str, TensorPlan]
    budget: int | None        # bytes for the planned matrices (None: fixed widths)
    other_bytes: int          # tensors kept in float32 outside the plan (norms, routers ...)
    sensitivity: dict | None = None  # the KL measurements that scaled the errors (Sensitivity.to_json)

    @property
    def planned_bytes(self) -> int:
        """Bytes of the planned matrices."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def total_bytes(self) -> int:
        """All weight bytes of the planned model."""
        return self.planned_bytes + self.other_bytes

    @property
    def bits_per_weight(self) -> float:
        """Average storage bits per weight of the planned matrices (scales included)."""
        weights = sum(t.shape[0] * t.shape[1] for t in self.tensors.values())
        return 8 * self.planned_bytes / weights if weights else 0.0

    def to_json(self) -> dict:
        """The manifest form."""
        out = {
            "budget": self.budget,
            "other_bytes": self.other_bytes,
            "bits_per_weight": round(self.bits_per_weight, 4),
            "tensors": {n: {k: (list(v) if k == "shape" else v) for k, v in asdict(t).items() if k != "name"}
                        for n, t in sorted(self.tensors.items())},
        }
        if self.sensitivity is not None:
            out["sensitivity"] = self.sensitivity
        return out


def parse_keep_bits(specs: Iterable[str]) -> list[tuple[str, int]]:
    """'PATTERN=BITS' strings -> [(glob pattern, bits)]; BITS is 2-8 or 32 (float32)."""
    out = []
    for spec in specs:
        pattern, sep, value = spec.rpartition("=")
        if not sep or not pattern:
            raise ColibriError(f"--keep-bits {spec!r}: expected PATTERN=BITS, e.g. '*lm_head*=8'")
        try:
            bits = int(value)
        except ValueError:
            raise ColibriError(f"--keep-bits {spec!r}: BITS must be one of {BIT_OPTIONS} or 32") from None
        if bits not in (*BIT_OPTIONS, FLOAT_BITS):
            raise ColibriError(f"--keep-bits {spec!r}: BITS must be one of {BIT_OPTIONS} or 32")
        out.append((pattern, bits))
    return out


def forced_bits(name: str, keep: list[tuple[str, int]]) -> int | None:
    """The width a --keep-bits pattern forces on a matrix (the last matching pattern wins)."""
    bits = None
    for pattern, b in keep:
        if fnmatch.fnmatchcase(name, pattern):
            bits = b
    return bits


def group_for(in_features: int, group: int) -> int:
    """The requested group size, or the largest smaller one that divides the row."""
    for g in (group, 128, 64, 32):
        if g <= group and in_features % g == 0:
            return g
    raise ColibriError(f"a row of {in_features} weights cannot be split in groups of 32, 64 or 128")


def sample_rows(w: np.ndarray, n: int = SAMPLE_ROWS) -> np.ndarray:
    """Evenly spaced rows (all of them for small matrices)."""
    if w.shape[0] <= n:
        return np.ascontiguousarray(w, dtype=np.float32)
    idx = np.linspace(0, w.shape[0] - 1, n).round().astype(np.int64)
    return np.ascontiguousarray(w[idx], dtype=np.float32)


def formats_for(in_features: int, bits_options: Iterable[int] = BIT_OPTIONS,
                groups: Iterable[int] = GROUP_OPTIONS) -> list[Format]:
    """Every format a row of `in_features` weights can take: each width at each group that divides
    the row, symmetric (except 2 bits, whose symmetric form wastes a level) and, up to
    ZERO_POINT_BITS, with zero points."""
    out = []
    for bits in bits_options:
        if bits == FLOAT_BITS:
            continue
        for g in groups:
            if in_features % g:
                continue
            if bits != 2:
                out.append(Format(bits, g, False))
            if bits <= ZERO_POINT_BITS:
                out.append(Format(bits, g, True))
    if not out:
        raise ColibriError(f"a row of {in_features} weights cannot be split in groups of 32, 64 or 128")
    return out


def measure_options(w: np.ndarray, importance: np.ndarray | None, usage: float,
                    formats: Iterable[Format]) -> list[Option]:
    """Bytes and usage-weighted output error of each format (and float32), measured on a sample of rows."""
    from engine.quant.tensor import quantized_error

    sample = sample_rows(w)
    scale = w.shape[0] / sample.shape[0]
    options = []
    for f in formats:
        err = quantized_error(sample, f.bits, f.group, importance=importance, asymmetric=f.asymmetric) * scale * usage
        options.append(Option(f.bits, row_bytes(w.shape[1], f) * w.shape[0], float(err), f.group, f.asymmetric))
    options.append(Option(FLOAT_BITS, w.shape[0] * w.shape[1] * 4, 0.0))
    return options


@functools.lru_cache(maxsize=256)
def row_bytes(in_features: int, f: Format) -> int:
    """Bytes of one row of `in_features` weights stored in format f, scales and zero points included (layouts are
    per row; cached: a model has a handful of row widths)."""
    from engine.quant import quantize

    return quantize(np.zeros((1, in_features), np.float32), f.bits, f.group, asymmetric=f.asymmetric).nbytes


def scaled(options: list[Option], factor: float) -> list[Option]:
    """The options with their errors times `factor` (a matrix's measured sensitivity)."""
    return [replace(o, error=o.error * factor) for o in options]


def allocate(options: Mapping[str, list[Option]], budget: int) -> dict[str, Option]:
    """Pick one option per matrix within `budget` bytes, greedily by error removed per byte.

    Each matrix starts at its smallest option; upgrades go to the lower convex hull of its
    (bytes, error) curve so that the greedy choice is the best rate at every step.
    """
    hulls = {name: _lower_hull(opts) for name, opts in options.items()}
    chosen = {name: 0 for name in hulls}
    spent = sum(h[0].nbytes for h in hulls.values())
    if spent > budget:
        smallest = spent
        raise ColibriError(
            f"the budget of {budget / 1e6:.1f} MB is below the {smallest / 1e6:.1f} MB the matrices need at "
            f"{min(o.bits for h in hulls.values() for o in h)} bits; raise the budget"
        )
    heap: list[tuple[float, str]] = []
    for name, hull in hulls.items():
        _push(heap, name, hull, 0)
    while heap:
        _, name = heapq.heappop(heap)
        hull, i = hulls[name], chosen[name]
        extra = hull[i + 1].nbytes - hull[i].nbytes
        if spent + extra > budget:
            continue  # this upgrade does not fit; cheaper ones elsewhere may
        spent += extra
        chosen[name] = i + 1
        _push(heap, name, hull, i + 1)
    return {name: hulls[name][i] for name, i in chosen.items()}


def _push(heap: list, name: str, hull: list[Option], i: int) -> None:
    if i + 1 < len(hull):
        gain = (hull[i].error - hull[i + 1].error) / max(hull[i + 1].nbytes - hull[i].nbytes, 1)
        heapq.heappush(heap, (-gain, name))


def _lower_hull(options: list[Option]) -> list[Option]:
    """Options on the lower convex hull of error against bytes, cheapest first."""
    pts = sorted(options, key=lambda o: (o.nbytes, o.error))
    hull: list[Option] = []
    for p in pts:
        if hull and p.error >= hull[-1].error:
            continue  # costs more, is no better
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b when the step a->p is steeper than a->b (b lies above the chord; collinear
            # points stay, as smaller steps the budget may still afford)
            if (a.error - p.error) * (b.nbytes - a.nbytes) > (a.error - b.error) * (p.nbytes - a.nbytes):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull
