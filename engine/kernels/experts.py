"""Fused routed experts: every selected expert of one MoE layer step in one call.

`moe_experts(x, ids, weights, experts)` returns, for each token t,

    out[t] = sum over slots k = 0 .. K-1, in order, of weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))

with e = ids[t, k]. The call runs in four steps: the gate and up rows of all chosen experts as one
list of work items spread over the threads, the SiLU product per slot, the down rows of all
experts as a second list, and the weighted sum per token in slot order (decode: two parallel
regions, each K experts x row chunks over both threads, instead of 3K kernel launches). Every number is computed as the
single-matrix kernel computes it (engine/kernels/matmul.py), so the result is bitwise independent
of the batch, of which other tokens chose the same expert, and of the thread count.

Experts arrive as separate QuantizedTensors or, from a GGUF file, KQuantTensors (K-quants and IQ4 in the file's
blocks; a Q4_K_M's gate and up may be Q4_K and its down Q6_K or Q8_0). The kernel receives a table of their
storage addresses and sizes (`QuantizedTensor.descriptor`, `KQuantTensor.descriptor`: same shape)
rather than a numba list or tuple of arrays: one compiled signature for any number of experts,
and no per-call list building (a typed list of a hundred arrays costs as much to build as a small call).
Items over K-quant matrices run through kquant.kq_run_items (the kernel a K-quant model's dense matrices compile
anyway), the others through matmul.run_items: a model without K-quants never compiles their kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

import numpy as np
from numba import njit

from engine.kernels.kquant import KQUANT_FLAG, kq_run_items
from engine.kernels.layout import DESCRIPTOR_FIELDS as DESCRIPTOR
from engine.kernels.layout import check_activations
from engine.kernels.matmul import run_items
from engine.kernels.simd import U64, fma32, vload_part, vsilu, vstore_part

if TYPE_CHECKING:
    from engine.quant.tensor import QuantizedTensor

ROWS_PER_ITEM = 64  # rows of one matrix per work item (a multiple of the 4-row tile)
F32 = np.float32


class ExpertLike(Protocol):
    """What the fused call needs of an expert (engine.blocks.ffn.ExpertWeights fits); a GGUF KQuantTensor may
    stand for any of the three (its descriptor has the same fields)."""

    gate: QuantizedTensor  # [I, hidden]
    up: QuantizedTensor    # [I, hidden]
    down: QuantizedTensor  # [hidden, I]


@njit(cache=True)
def plan_slots(ids, needed, inter, hidden, k_slots):
    """Group the T*K slots by expert and cut the work into items for kernels.run_items.

    ids [T*K] expert per slot, needed [E] the distinct ids sorted. Returns (order [T*K]: slots grouped by
    expert, each group in slot order; tok [T*K]: the token of each ordered slot; gate/up items over the
    table [gate_0, up_0, gate_1, ...]; down items over the table [down_0, down_1, ...]).
    """
    n_e = needed.shape[0]
    n_slots = ids.shape[0]
    local = np.searchsorted(needed, ids)
    starts = np.zeros(n_e + 1, np.int64)
    for s in range(n_slots):
        starts[local[s] + 1] += 1
    for e in range(n_e):
        starts[e + 1] += starts[e]
    fill = starts[:-1].copy()
    order = np.empty(n_slots, np.int64)
    for s in range(n_slots):
        order[fill[local[s]]] = s
        fill[local[s]] += 1
    # items chunk-major (every expert's first rows, then the next ...): a static split over the
    # threads then gives each thread a share of every expert, however unevenly tokens chose them
    gate_up = _expert_items(2 * n_e, inter, starts, n_slots * inter, inter, 2)
    down = _expert_items(n_e, hidden, starts, 0, hidden, 1)
    return order, order // k_slots, gate_up, down


@njit(cache=True)
def _expert_items(n_mats, rows, starts, buffer_stride, ldo, per_expert):
    """Items over n_mats matrices of `rows` rows; matrix m belongs to expert m // per_expert and writes the output
    buffer (m % per_expert) of size buffer_stride."""
    chunks = (rows + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    items = np.empty((chunks * n_mats, 7), np.int64)
    for n in range(chunks * n_mats):
        m, c = n % n_mats, n // n_mats
        e = m // per_expert
        items[n, 0] = m
        items[n, 1] = c * ROWS_PER_ITEM
        items[n, 2] = min(rows, (c + 1) * ROWS_PER_ITEM)
        items[n, 3] = starts[e]
        items[n, 4] = starts[e + 1]
        items[n, 5] = (m % per_expert) * buffer_stride
        items[n, 6] = ldo
    return items


@njit(boundscheck=False)
def silu_rows(g, go, u, uo, out, oo, n):
    """out[oo + i] = silu(g[go + i]) * u[uo + i] for i < n (flat float32), 16 lanes at a time (simd.vsilu):
    each element's value depends on its own g and u only, however the elements are cut."""
    for i in range(0, n, 16):
        m = min(16, n - i)
        vstore_part(out, oo + U64(i), vsilu(vload_part(g, go + U64(i), m), vload_part(u, uo + U64(i), m)), m)


@njit(cache=True, boundscheck=False)
def silu_product(gate_up, n_slots, inter):
    """h = silu(gate) * up per slot (gate_up flat [2, slots, I]) -> [slots, I] (engine.kernels.rows has the same)."""
    h = np.empty(n_slots * inter, np.float32)
    silu_rows(gate_up, U64(0), gate_up, U64(n_slots * inter), h, U64(0), n_slots * inter)
    return h


@njit(cache=True, boundscheck=False)
def sum_slots(y, weights, k_slots, hidden, out):
    """out[t] = sum over k in order of weights[t, k] * y[t * K + k] (one fma per slot), y flat [slots, hidden]."""
    for t in range(weights.shape[0] // k_slots):
        for i in range(hidden):
            acc = F32(0.0)
            for k in range(k_slots):
                s = t * k_slots + k
                acc = fma32(weights[s], y[U64(s) * U64(hidden) + U64(i)], acc)
            out[U64(t) * U64(hidden) + U64(i)] = acc


def moe_experts(x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                experts: Mapping[int, ExpertLike] | Sequence[ExpertLike]) -> np.ndarray:
    """x [T, hidden], ids [T, K] expert ids, weights [T, K] -> [T, hidden] = sum_k weights * down(silu(gate x) * up x).

    `experts` maps an expert id to its gate, up, down QuantizedTensors or KQuantTensors (a dict from
    ExpertSource.experts, or a list indexed by id). Bitwise independent of T, of the other tokens in the batch and
    of the thread count.
    """
    x, ids, weights = check_routing(x, ids, weights)
    t, k = ids.shape
    out = np.zeros((t, x.shape[1]), np.float32)
    if t == 0 or k == 0:
        return out
    y = np.empty((t * k, x.shape[1]), np.float32)
    expert_outputs(x, ids, experts, np.arange(t * k), y)
    return weighted_sum(y, weights, out)


def check_routing(x, ids, weights) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, ids, weights) checked: x [T, hidden] float32 contiguous, ids [T, K] integers, weights [T, K] float32."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise ValueError(f"expert ids must be an integer [T, K] array, got {ids.dtype} {list(ids.shape)}")
    weights = np.asarray(weights)
    if weights.shape != ids.shape or weights.dtype != np.float32:
        raise ValueError(f"expert weights must be float32 of the ids' shape {list(ids.shape)}, "
                         f"got {weights.dtype} {list(weights.shape)}")
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError(f"activations must be a [T, hidden] array, got {getattr(x, 'shape', type(x).__name__)}")
    if x.shape[0] != ids.shape[0]:
        raise ValueError(f"activations have {x.shape[0]} tokens but the routing {ids.shape[0]}")
    return check_activations(x, x.shape[1]), ids, weights


def weighted_sum(y: np.ndarray, weights: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out [T, hidden] = sum over slots k in order of weights[t, k] * y[t * K + k] (y [T*K, hidden]); returns out."""
    t, k = weights.shape
    sum_slots(y.reshape(-1), np.ascontiguousarray(weights, np.float32).reshape(-1), k, out.shape[1], out.reshape(-1))
    return out


def expert_outputs(x: np.ndarray, ids: np.ndarray, experts: Mapping[int, ExpertLike] | Sequence[ExpertLike],
                   slots: np.ndarray, y: np.ndarray) -> None:
    """y[s] = down_e(silu(gate_e(x_t)) * up_e(x_t)) for the given slots s = t * K + k (e = ids[t, k]).

    Every slot's row is computed as it would be in any other batch, so a layer step may run its slots in
    parts (the experts already in memory first, the others as their reads finish) with the same result.
    """
    t, k = ids.shape
    hidden = x.shape[1]
    slots = np.asarray(slots, np.int64)                                      # sorted, distinct
    if slots.size == 0:
        return
    flat = ids.reshape(-1).astype(np.int64, copy=False)[slots]
    needed = sorted(set(flat.tolist())) if flat.size <= 256 else np.unique(flat).tolist()
    if needed[0] < 0:
        raise ValueError(f"expert ids must be >= 0, got {needed[0]}")
    rows = [_descriptors(experts, i) for i in needed]
    inter, d = rows[0][3], DESCRIPTOR
    for i, row in zip(needed, rows):
        gate, up, down = row[3:5], row[d + 3:d + 5], row[2 * d + 3:2 * d + 5]          # (out, in) of each
        if gate != (inter, hidden) or up != (inter, hidden) or down != (hidden, inter):
            raise ValueError(f"expert {i}: gate {list(gate)}, up {list(up)}, down {list(down)} "
                             f"do not fit hidden {hidden} and intermediate {inter}")
    table = np.array(rows, np.int64).reshape(len(needed), 3, DESCRIPTOR)
    n_slots = flat.size
    order, _, gate_up_items, down_items = plan_slots(flat, np.array(needed, np.int64), inter, hidden, k)
    tok = slots[order] // k                                                  # the token of each ordered slot
    gate_up = np.empty(2 * n_slots * inter, np.float32)                     # [gate | up][slot, I]
    _run(table[:, :2].reshape(-1, DESCRIPTOR), gate_up_items, x.reshape(-1), tok, order, gate_up)
    h = silu_product(gate_up, n_slots, inter)                                # [slot, I]
    if n_slots == t * k and slots[0] == 0 and slots[-1] == n_slots - 1:     # every slot, in order: y in place
        _run(table[:, 2], down_items, h, order, order, y.reshape(-1))
        return
    part = np.empty(n_slots * hidden, np.float32)                            # [slot of the part, hidden]
    _run(table[:, 2], down_items, h, order, order, part)
    y[slots] = part.reshape(n_slots, hidden)


def _run(table: np.ndarray, items: np.ndarray, x: np.ndarray, xrows: np.ndarray, orows: np.ndarray,
         out: np.ndarray) -> None:
    """Work items (one a piece) over a table of descriptors [M, 13]: those of GGUF K-quant (or IQ4) matrices by their
    kernels, the others by Colibri's; each item writes its own part of `out`, so splitting them changes no bit."""
    kq = table[:, 0] == KQUANT_FLAG                                          # [M]
    if not kq.any():
        run_items(np.ascontiguousarray(table), items, np.arange(len(items) + 1), x, xrows, orows, out)
        return
    mine = kq[items[:, 0]]                                                   # [items]
    # kq_run_items' table rows: kind, rows, cols, address, bytes (KQuantTensor.descriptor's fields 1, 3 .. 6)
    k_items = np.ascontiguousarray(items[mine])
    kquant_table = np.ascontiguousarray(table[:, [1, 3, 4, 5, 6]])
    kq_run_items(kquant_table, k_items, np.arange(len(k_items) + 1), x, xrows, orows, out)
    if not mine.all():                                                       # a mix: a Q4_K gate beside a Q8_0 down
        rest = np.ascontiguousarray(items[~mine])
        run_items(np.ascontiguousarray(table), rest, np.arange(len(rest) + 1), x, xrows, orows, out)


def _descriptors(experts, i: int) -> tuple[int, ...]:
    """gate, up, down descriptors of expert i, concatenated (QuantizedTensor or KQuantTensor: the same 13 fields);
    ValueError when missing or not quantized."""
    try:
        e = experts[i]
        return e.gate.descriptor + e.up.descriptor + e.down.descriptor
    except (KeyError, IndexError):
        raise ValueError(f"routing chose expert {i} but no weights were given for it") from None
    except AttributeError:
        raise ValueError(f"expert {i}: the fused kernel runs quantized experts only (QuantizedTensor or KQuantTensor "
                         "gate, up, down); run float32 experts with gated_mlp") from None
