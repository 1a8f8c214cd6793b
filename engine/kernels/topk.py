"""Which of several exactly tied scores a top-k keeps, as the reference keeps them.

The reference's sparse-attention indexer takes `torch.topk` of each query's key scores on the CPU, which
runs libstdc++'s `std::nth_element` (or `std::partial_sort` when k * 64 <= n) on (score, position) pairs
compared by score alone. Among exactly equal scores at the top-k boundary (frequent with few indexer heads:
relu zeroes whole rows of scores) the kept ones are whichever those algorithms leave in front; this module
replays them step by step, so the same row gives the same set. Only rows with a tie across the boundary
need it (`engine.kernels.sparse.top_keys`).
"""

from __future__ import annotations

import math
from typing import Sequence


def _gt(a: float, b: float) -> bool:
    """torch's comparator for the largest k: NaN ranks first, then greater values."""
    return (math.isnan(a) and not math.isnan(b)) or a > b


def _adjust_heap(v: list, ix: list, first: int, hole: int, length: int, val: tuple) -> None:
    top = second = hole
    while second < (length - 1) // 2:
        second = 2 * (second + 1)
        if _gt(v[first + second], v[first + second - 1]):
            second -= 1
        v[first + hole], ix[first + hole] = v[first + second], ix[first + second]
        hole = second
    if (length & 1) == 0 and second == (length - 2) // 2:
        second = 2 * (second + 1)
        v[first + hole], ix[first + hole] = v[first + second - 1], ix[first + second - 1]
        hole = second - 1
    parent = (hole - 1) // 2
    while hole > top and _gt(v[first + parent], val[0]):
        v[first + hole], ix[first + hole] = v[first + parent], ix[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    v[first + hole], ix[first + hole] = val


def _heap_select(v: list, ix: list, first: int, middle: int, last: int) -> None:
    length = middle - first
    if length >= 2:
        parent = (length - 2) // 2
        while True:
            _adjust_heap(v, ix, first, parent, length, (v[first + parent], ix[first + parent]))
            if parent == 0:
                break
            parent -= 1
    for i in range(middle, last):
        if _gt(v[i], v[first]):
            val = (v[i], ix[i])
            v[i], ix[i] = v[first], ix[first]
            _adjust_heap(v, ix, first, 0, length, val)


def _swap(v: list, ix: list, a: int, b: int) -> None:
    v[a], v[b] = v[b], v[a]
    ix[a], ix[b] = ix[b], ix[a]


def _insertion_sort(v: list, ix: list, first: int, last: int) -> None:
    for i in range(first + 1, last):
        val = (v[i], ix[i])
        if _gt(val[0], v[first]):
            v[first + 1 : i + 1], ix[first + 1 : i + 1] = v[first:i], ix[first:i]
            v[first], ix[first] = val
            continue
        hole = i
        while _gt(val[0], v[hole - 1]):
            v[hole], ix[hole] = v[hole - 1], ix[hole - 1]
            hole -= 1
        v[hole], ix[hole] = val


def _median_to_first(v: list, ix: list, result: int, a: int, b: int, c: int) -> None:
    if _gt(v[a], v[b]):
        if _gt(v[b], v[c]):
            _swap(v, ix, result, b)
        elif _gt(v[a], v[c]):
            _swap(v, ix, result, c)
        else:
            _swap(v, ix, result, a)
    elif _gt(v[a], v[c]):
        _swap(v, ix, result, a)
    elif _gt(v[b], v[c]):
        _swap(v, ix, result, c)
    else:
        _swap(v, ix, result, b)


def _partition(v: list, ix: list, first: int, last: int) -> int:
    """Median-of-three pivot moved to `first`, then the unguarded Hoare partition of the rest."""
    _median_to_first(v, ix, first, first + 1, first + (last - first) // 2, last - 1)
    lo, hi = first + 1, last
    while True:
        while _gt(v[lo], v[first]):
            lo += 1
        hi -= 1
        while _gt(v[first], v[hi]):
            hi -= 1
        if not lo < hi:
            return lo
        _swap(v, ix, lo, hi)
        lo += 1


def _nth_element(v: list, ix: list, nth: int) -> None:
    """Introselect: partition until the range holding `nth` is at most 3 long (heap select past the depth limit)."""
    first, last = 0, len(v)
    if nth >= last:
        return
    depth = 2 * (last.bit_length() - 1)
    while last - first > 3:
        if depth == 0:
            _heap_select(v, ix, first, nth + 1, last)
            _swap(v, ix, first, nth)
            return
        depth -= 1
        cut = _partition(v, ix, first, last)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(v, ix, first, last)


def reference_topk(values: Sequence[float], k: int) -> list[int]:
    """The positions (ascending) of the k largest values as torch.topk keeps them on the CPU, ties included."""
    v = [float(x) for x in values]
    ix = list(range(len(v)))
    if k * 64 <= len(v):
        _heap_select(v, ix, 0, k, len(v))    # std::partial_sort keeps its heap's set
    else:
        _nth_element(v, ix, k - 1)
    return sorted(ix[:k])
