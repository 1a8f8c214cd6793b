"""The fused decode step of a batch: one token of each of B sequences through every layer in one parallel region.

B sequences decoding one token each could run B fused steps (engine/fused/kernel.py), each reading every weight
of the model. Here one step runs them all: each product reads a chunk of a matrix once for all B rows (the
tiled product of engine/kernels/matmul.py dequantizes each 4-row tile once, then runs it over the rows),
attention runs per row on its own cache rows and position, and each thread keeps its own copy of every row's
hidden state, as the single step does for one. It runs on all of numba's threads or on one, whichever ran steps of
the batch's size faster (as the single step chooses its threads).

A layer of routed experts reads each expert the batch chose once (the seeds' "Union"): every thread routes
every row, sorts the rows' slots by expert (the same order in each thread), and the expert steps' chunks are
an expert's rows times the rows that chose it, the slots' outputs then weighted per row in slot order as the
single step weighs them.

Every number is computed by the functions the single step and the blocks call, on the same inputs (each product
element by the one fixed sequence of float32 operations the matmul contract gives for any count of tokens), so
each row's logits are bitwise those of its own single step. Taken: models whose layers the single step runs
(SiLU-gated MLPs, routed experts resident or streamed).

A streamed layer whose union is all in memory as the call begins runs on; at another the call stops after the
routing, and the caller brings the union in through the store's `groups` (each expert read once, the resident
ones first), a call resumed at the layer's experts per group, as the single step does without its driver (a
batch does not read ahead: the union of several rows' guesses is most of a layer).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numba
import numpy as np
from numba import njit, prange

from engine.blocks.ffn import Routing
from engine.fused import kernel as fk
from engine.fused.kernel import attend_chunk
from engine.fused.sync import LINE, atomic_load, atomic_store, spin_pause
from engine.kernels.experts import silu_rows
from engine.kernels.kquant import KQUANT_FLAG, kq_desc_rows
from engine.kernels.matmul import TILE, planes, quant_rows, tile_rows
from engine.kernels.rows import norm_row, route_row
from engine.kernels.simd import U64, fma32
from engine.kv import KVCache
from engine.tuning import BySize, ThreadChoice

if TYPE_CHECKING:
    from engine.fused.plan import FusedDecode

F32 = np.float32
# offsets of a layer's buffers in its slab of `shared` (bo [N_BO] int64), each holding B rows: q/k/v projections,
# attention heads, attention output, gate and up, their SiLU product, the MLP output (of each row's K slots in a
# layer of experts: slot b * K + k), router logits; then the slab's size. Then the offsets in a thread's int64
# scratch `iv` (an expert layer's union; at 0 the start of each expert's run of slots, [E + 1]): the experts
# chosen ascending [E], each slot's expert [B * K], and per place in the runs the slot's row and the slot [B * K].
BO_QKV, BO_ATT, BO_O, BO_GU, BO_HB, BO_Y, BO_RL, BO_LAYER, BO_I_ACT, BO_I_IDS, BO_I_XS, BO_I_OS, BO_I_SIZE, N_BO = \
    range(14)


@njit(boundscheck=False)
def _product(desc, kquant, r0, r1, x, xrows, orows, i0, i1, out, ldo, col0, scratch):
    """Rows r0 .. r1 - 1 of the matrix `desc` describes times rows xrows[i0:i1] of x (flat [., cols]) ->
    out[orows[i] * ldo + col0 + r - r0]: each weight tile read once for all rows, by the kernels the single step
    runs (kquant None: no matrix is a K-quant, and their kernels are not compiled)."""
    if kquant is not None:
        if desc[0] == KQUANT_FLAG:
            kq_desc_rows(desc, r0, r1 - r0, x, xrows, orows, i0, i1, out, ldo, col0)
            return
    bits, asym, group, _, cols, a, b, sc, mn = planes(desc)
    quant_rows(bits, asym, group, a, b, sc, mn, cols, r0, r1, x, xrows, orows, i0, i1, out, ldo, col0, scratch)


@njit(boundscheck=False)
def _experts0(lay, l):
    """The first descriptor row of layer l's experts, three per expert id: the plan's own, or for a streamed layer
    the rows the store's experts in memory are written to (their flags set, or brought for this call)."""
    return lay[l, fk.L_RES0] if lay[l, fk.L_STREAMED] != 0 else lay[l, fk.L_EXP0]


@njit(boundscheck=False)
def _chunk(kind, c, l, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps, lb, h, scr, tile, rows,
           iv, logits):
    """Chunk c of step `kind` of layer l for the batch (lb: the layer's slab; h, scr, tile, iv: the thread's own)."""
    hidden, n_rows = g[fk.G_HIDDEN], rows.shape[0]
    d, dv = lay[l, fk.L_D], lay[l, fk.L_DV]
    qs = lay[l, fk.L_H] * d + lay[l, fk.L_HKV] * (d + dv)        # a row's q, k, v features
    att = lay[l, fk.L_H] * dv                                    # and attention heads
    if kind == fk.S_QKV:
        i = lay[l, fk.L_QKV0] + c
        _product(descs[items[i, 0]], kquant, items[i, 1], items[i, 2], h, rows, rows, 0, n_rows, lb[bo[BO_QKV]:], qs,
                 items[i, 3] + items[i, 1], tile)
    elif kind == fk.S_O:
        i = lay[l, fk.L_O0] + c
        _product(descs[items[i, 0]], kquant, items[i, 1], items[i, 2], lb[bo[BO_ATT]:], rows, rows, 0, n_rows,
                 lb[bo[BO_O]:], hidden, items[i, 3] + items[i, 1], tile)
    elif kind == fk.S_HEAD:
        i = g[fk.G_HEAD0] + c
        _product(descs[items[i, 0]], kquant, items[i, 1], items[i, 2], h, rows, rows, 0, n_rows, logits,
                 logits.shape[0] // n_rows, items[i, 3] + items[i, 1], tile)
    elif kind == fk.S_KV or kind == fk.S_HEADS:     # kv or query head c % heads of row c // heads
        heads = lay[l, fk.L_HKV] if kind == fk.S_KV else lay[l, fk.L_H]
        b = c // heads
        attend_chunk(kind, c % heads, l, lay, lf, fpar, kvaddr, tables[b], pos[b], cs[b], eps,
                     lb[bo[BO_QKV] + b * qs:], lb[bo[BO_ATT] + b * att:], scr)
    elif kind == fk.S_ROUTER:                       # 16 router rows per chunk, 4 at a time, for every row
        n_exp = lay[l, fk.L_E]
        r = c * 16
        while r < min(n_exp, c * 16 + 16):
            tile_rows(fpar[lay[l, fk.L_ROUTER]:], U64(r) * U64(hidden), hidden, min(TILE, n_exp - r), h, rows, rows, 0,
                      n_rows, lb[bo[BO_RL]:], n_exp, r)
            r += TILE
    elif kind == fk.S_GATE_UP:
        # rows r0 .. r1 of a gate and an up matrix times the rows that use it (the dense MLP: all, each in its row;
        # expert act[u]: those whose slots chose it, each in its slot), then their SiLU products
        inter_ff, per_rows = lay[l, fk.L_I], lay[l, fk.L_ROWS_IN]
        per = (inter_ff + per_rows - 1) // per_rows
        r0 = (c % per) * per_rows
        r1 = min(inter_ff, r0 + per_rows)
        gu, hb = lb[bo[BO_GU]:], lb[bo[BO_HB]:]
        if lay[l, fk.L_MOE] != 0:
            e = iv[bo[BO_I_ACT] + c // per]
            m0, i0, i1 = _experts0(lay, l) + 3 * e, iv[e], iv[e + 1]
            xs, os = iv[bo[BO_I_XS]:], iv[bo[BO_I_OS]:]
        else:
            m0, i0, i1, xs, os = lay[l, fk.L_GATE], 0, n_rows, rows, rows
        for m in range(2):
            _product(descs[m0 + m], kquant, r0, r1, h, xs, os, i0, i1, gu, 2 * inter_ff, m * inter_ff + r0, tile)
        for i in range(i0, i1):
            s = os[i]
            silu_rows(gu, U64(2 * s * inter_ff + r0), gu, U64((2 * s + 1) * inter_ff + r0), hb, U64(s * inter_ff + r0),
                      r1 - r0)
    else:  # S_DOWN: rows r0 .. r1 of the down matrix times the SiLU products of the rows (slots) that use it
        per_rows = lay[l, fk.L_ROWS_DOWN]
        per = (hidden + per_rows - 1) // per_rows
        r0 = (c % per) * per_rows
        r1 = min(hidden, r0 + per_rows)
        if lay[l, fk.L_MOE] != 0:
            e = iv[bo[BO_I_ACT] + c // per]
            m, i0, i1, os = _experts0(lay, l) + 3 * e + 2, iv[e], iv[e + 1], iv[bo[BO_I_OS]:]
        else:
            m, i0, i1, os = lay[l, fk.L_DOWN], 0, n_rows, rows
        _product(descs[m], kquant, r0, r1, lb[bo[BO_HB]:], os, os, i0, i1, lb[bo[BO_Y]:], hidden, r0, tile)


@njit(boundscheck=False)
def _step(kind, n, first, l, tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps, lb,
          h, scr, tile, rows, iv, logits):
    """Run step `kind` of layer l (n chunks, flags done[first:first + n]) with the other threads, as the single
    step's `_step` does: own chunks first, then wait for the others', computing one whose owner is off the core."""
    for c in range(n * tid // threads, n * (tid + 1) // threads):
        if atomic_load(done, U64(first + c)) == 0:
            _chunk(kind, c, l, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps, lb, h, scr, tile, rows,
                   iv, logits)
            atomic_store(done, U64(first + c), 1)
    for c in range(n - 1, -1, -1):
        spins = 0
        while atomic_load(done, U64(first + c)) == 0:
            if spins < fk.STEAL:
                spin_pause()
                spins += 1
            else:  # the same chunk again, the same bits
                _chunk(kind, c, l, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps, lb, h, scr, tile,
                       rows, iv, logits)
                atomic_store(done, U64(first + c), 1)


@njit(boundscheck=False)
def _union(l, tid, threads, done, first, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps, lb, h,
           scr, tile, rows, iv, w, rids, rw, logits):
    """Layer l's experts: every row's router logits (a step with the other threads), then this thread routes every
    row (ids into iv, weights w [B * K]; reported in rids/rw [l]) and lays out their union (`_layout`). Returns how
    many experts were chosen."""
    n_rows, n_exp, top_k = pos.shape[0], lay[l, fk.L_E], lay[l, fk.L_K]
    _step(fk.S_ROUTER, (n_exp + 15) // 16, first, l, tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar,
          kvaddr, tables, pos, cs, eps, lb, h, scr, tile, rows, iv, logits)
    bias = fpar[lay[l, fk.L_BIAS]:lay[l, fk.L_BIAS] + n_exp] if lay[l, fk.L_BIAS] >= 0 else fpar[:0]
    ids = iv[bo[BO_I_IDS]:]
    for b in range(n_rows):
        route_row(lb[bo[BO_RL]:], U64(b * n_exp), n_exp, top_k, lay[l, fk.L_SCORING], bias, lay[l, fk.L_NORM_TOPK] != 0,
                  lf[l, 1], scr, ids, U64(b * top_k), w, U64(b * top_k))
    for s in range(n_rows * top_k):
        rids[l, s] = ids[s]
        rw[l, s] = w[s]
    return _layout(n_rows * top_k, n_exp, top_k, bo, iv)


@njit(boundscheck=False)
def _layout(n, n_exp, top_k, bo, iv):
    """The union of the n slots' experts (iv's ids): each chosen expert's run of slots, rows ascending (iv[e] where
    expert e's run starts), and the experts chosen, ascending. Returns how many were chosen."""
    ids, act = iv[bo[BO_I_IDS]:], iv[bo[BO_I_ACT]:]
    xs, os = iv[bo[BO_I_XS]:], iv[bo[BO_I_OS]:]
    for e in range(n_exp + 1):
        iv[e] = 0
    for s in range(n):
        iv[ids[s] + 1] += 1
    for e in range(n_exp):
        iv[e + 1] += iv[e]
    for e in range(n_exp):                                            # (act as each run's cursor)
        act[e] = iv[e]
    for s in range(n):                                                # slots ascending: rows ascending in a run
        e = ids[s]
        xs[act[e]] = s // top_k
        os[act[e]] = s
        act[e] += 1
    chosen = 0
    for e in range(n_exp):
        if iv[e + 1] > iv[e]:
            act[chosen] = e
            chosen += 1
    return chosen


@njit(boundscheck=False)
def _worker(tid, threads, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps, x0, shared, priv, per,
            scr_size, iv, w, rids, rw, chosen, logits, sync, done, run, state, held, pick):
    hidden, n_rows = g[fk.G_HIDDEN], pos.shape[0]
    po = tid * per
    x = priv[po:po + n_rows * hidden]                                 # this thread's copy of the hidden states
    h = priv[po + n_rows * hidden:po + 2 * n_rows * hidden]           # their normed inputs of the next products
    scr = priv[po + 2 * n_rows * hidden:po + 2 * n_rows * hidden + scr_size]   # attention scratch
    tile = priv[po + 2 * n_rows * hidden + scr_size:po + per]         # a dequantized tile of 4 rows
    rows = np.arange(n_rows)
    end = g[fk.G_STEPS] * LINE                                        # set when the call is done
    fw = g[fk.G_FLAGW]
    start, resume = run[fk.RUN_START], run[fk.RUN_RESUME] != 0
    src = state if resume else x0
    for i in range(n_rows * hidden):
        x[i] = src[i]
    first = np.int64(0)                                               # not a literal 0: _step compiles once
    for l in range(start, g[fk.G_LAYERS]):
        if atomic_load(sync, U64(end)) != 0:
            return
        lb = shared[l * bo[BO_LAYER]:(l + 1) * bo[BO_LAYER]]
        streamed = lay[l, fk.L_STREAMED] != 0
        again = resume and l == start                                 # resumed at this layer's experts
        slots = 1                                                     # per row: 1, or K in a layer of experts
        if again:
            # attention and routing ran in an earlier call: the routing back from rids/rw, and the experts of this
            # call's group (pick) of the union
            top_k = lay[l, fk.L_K]
            for i in range(n_rows * hidden):
                h[i] = state[n_rows * hidden + i]
            ids = iv[bo[BO_I_IDS]:]
            for s in range(n_rows * top_k):
                ids[s] = rids[l, s]
                w[s] = rw[l, s]
            slots = _layout(n_rows * top_k, lay[l, fk.L_E], top_k, bo, iv)
            act = iv[bo[BO_I_ACT]:]
            kept = 0
            for j in range(slots):
                if pick[act[j]] != 0:
                    act[kept] = act[j]
                    kept += 1
            slots = kept
        else:
            for b in range(n_rows):
                norm_row(x, U64(b * hidden), fpar[lay[l, fk.L_IN_NORM]:], eps, hidden, h, U64(b * hidden))
            n = lay[l, fk.L_QKV1] - lay[l, fk.L_QKV0]
            _step(fk.S_QKV, n, first, l, tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables,
                  pos, cs, eps, lb, h, scr, tile, rows, iv, logits)
            first += n
            n = n_rows * lay[l, fk.L_HKV]
            _step(fk.S_KV, n, first, l, tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables,
                  pos, cs, eps, lb, h, scr, tile, rows, iv, logits)
            first += n
            n = n_rows * lay[l, fk.L_H]
            _step(fk.S_HEADS, n, first, l, tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr,
                  tables, pos, cs, eps, lb, h, scr, tile, rows, iv, logits)
            first += n
            n = lay[l, fk.L_O1] - lay[l, fk.L_O0]
            _step(fk.S_O, n, first, l, tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables,
                  pos, cs, eps, lb, h, scr, tile, rows, iv, logits)
            first += n
            o = lb[bo[BO_O]:]
            for i in range(n_rows * hidden):
                x[i] = x[i] + o[i]
            for b in range(n_rows):
                norm_row(x, U64(b * hidden), fpar[lay[l, fk.L_POST_NORM]:], eps, hidden, h, U64(b * hidden))
            if lay[l, fk.L_MOE] != 0:
                slots = _union(l, tid, threads, done, first, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr,
                               tables, pos, cs, eps, lb, h, scr, tile, rows, iv, w, rids, rw, logits)
                chosen[l] = slots                                     # (every thread: the same count)
                first += (lay[l, fk.L_E] + 15) // 16
                if streamed:
                    # `held` is the flags as the call began (the same in every thread): an expert not in memory
                    # then stops the call here, and the caller brings the union's experts in groups
                    act = iv[bo[BO_I_ACT]:]
                    for j in range(slots):
                        if held[l * fw + act[j]] != 1:
                            for i in range(n_rows * hidden):
                                state[i] = x[i]
                                state[n_rows * hidden + i] = h[i]
                            run[fk.RUN_EXIT] = l
                            atomic_store(sync, U64(end), 1)
                            return
        n = slots * ((lay[l, fk.L_I] + lay[l, fk.L_ROWS_IN] - 1) // lay[l, fk.L_ROWS_IN])
        _step(fk.S_GATE_UP, n, first, l, tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables,
              pos, cs, eps, lb, h, scr, tile, rows, iv, logits)
        first += n
        n = slots * ((hidden + lay[l, fk.L_ROWS_DOWN] - 1) // lay[l, fk.L_ROWS_DOWN])
        _step(fk.S_DOWN, n, first, l, tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables,
              pos, cs, eps, lb, h, scr, tile, rows, iv, logits)
        first += n
        if again and run[fk.RUN_LAST] == 0:                          # more of this layer's experts are to come
            run[fk.RUN_EXIT] = l
            atomic_store(sync, U64(end), 1)
            return
        y = lb[bo[BO_Y]:]
        if lay[l, fk.L_MOE] != 0:
            top_k = lay[l, fk.L_K]
            for b in range(n_rows):                                   # each row's slots weighted in slot order,
                for i in range(hidden):                               # as the single step weighs them
                    acc = F32(0.0)
                    for k in range(top_k):
                        acc = fma32(w[b * top_k + k], y[(b * top_k + k) * hidden + i], acc)
                    x[b * hidden + i] = x[b * hidden + i] + acc
        else:
            for i in range(n_rows * hidden):
                x[i] = x[i] + y[i]
    for b in range(n_rows):
        norm_row(x, U64(b * hidden), fpar[g[fk.G_NORM]:], eps, hidden, h, U64(b * hidden))
    n = g[fk.G_HEAD1] - g[fk.G_HEAD0]
    _step(fk.S_HEAD, n, first, np.int64(0), tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps,
          shared[:0], h, scr, tile, rows, iv, logits)
    run[fk.RUN_EXIT] = g[fk.G_LAYERS]
    atomic_store(sync, U64(end), 1)


@njit(parallel=True, nogil=True, cache=True, boundscheck=False)
def decode_batch(threads, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps, x0, shared, priv, per,
                 scr_size, ivs, ws, rids, rw, chosen, logits, sync, done, run, state, held, pick):  # pragma: no cover
    """One token of each of B rows (embeddings x0 flat [B, hidden], row b at pos[b] of the cache blocks tables[b])
    through the layers -> logits flat [B, V], each expert layer's routing in rids/rw [L, B * K] and the count of
    experts its rows chose in chosen [L] (see the module docstring). ivs and ws: per thread, bo[BO_I_SIZE] int64
    and B * K float32 of scratch.

    Streamed layers (the single step's `run` words, engine/fused/kernel.py): a call stops at the first one whose
    union has an expert not flagged in `held` [L * G_FLAGW] (the flags as the call began), with RUN_EXIT that
    layer and the rows' x and h [2 * B * hidden] in `state`; each call resumed there (RUN_RESUME) runs the experts
    of the union flagged in pick [E] (their descriptors written for it), and the one with RUN_LAST goes on."""
    for tid in prange(threads):
        # int64: parfor types tid signed, then unsigned in its gufunc; one type compiles _worker once
        t = np.int64(tid)
        nw = ws.shape[0] // threads
        _worker(t, threads, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps, x0, shared, priv, per,
                scr_size, ivs[t * bo[BO_I_SIZE]:(t + 1) * bo[BO_I_SIZE]], ws[t * nw:(t + 1) * nw], rids, rw, chosen,
                logits, sync, done, run, state, held, pick)


class BatchedDecode:
    """One token of each of several sequences as one fused step, over a single step's plan (its matrices, layer
    table and parameters)."""

    def __init__(self, plan: "FusedDecode") -> None:
        self.plan = plan
        lay = plan.lay
        self.qkv = int(max(lay[i, fk.L_H] * lay[i, fk.L_D] + lay[i, fk.L_HKV] * (lay[i, fk.L_D] + lay[i, fk.L_DV])
                           for i in range(lay.shape[0])))
        self.att = int(max(lay[i, fk.L_H] * lay[i, fk.L_DV] for i in range(lay.shape[0])))
        self.inter = int(lay[:, fk.L_I].max())
        moe = lay[:, fk.L_MOE] != 0
        self.slots = int(lay[moe, fk.L_K].max()) if moe.any() else 1     # a row's outputs of an MLP step: K slots
        self.experts = int(lay[moe, fk.L_E].max()) if moe.any() else 0
        # the widest matrix's columns (a streamed layer's expert rows are written per call: their widths from lay)
        self.cols = int(max(plan.descs[:, 4].max(), plan.hidden, lay[moe, fk.L_I].max() if moe.any() else 0))
        self._shared: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # rows -> (bo, shared)
        # all of numba's threads, or one when steps with one were faster (other programs on the cores), per batch size
        self._threads: BySize[ThreadChoice] = BySize(ThreadChoice)
        # per batch size: steps run, and the experts they read (each layer's union, summed over layers and steps)
        self.reads: dict[int, list[int]] = {}

    @classmethod
    def for_plan(cls, plan: "FusedDecode | None") -> "BatchedDecode | None":
        """The batched step of a single step's plan (None: no plan)."""
        return None if plan is None else cls(plan)

    def tries(self, n: int) -> int:
        """Steps of n sequences run on the thread count not chosen, to measure it (see FasterChoice.tries)."""
        return self._threads[n].tries

    def accepts(self, caches: list[KVCache]) -> bool:
        """Whether these sequences' caches can run together: one pool of plain attention layers, no retention."""
        pool = caches[0].pool
        return all(c.pool is pool and not c.tracking for c in caches) and self.plan.accepts(caches[0])

    def _buffers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        held = self._shared.get(n)
        if held is None:
            hidden = self.plan.hidden
            k = self.slots
            sizes = [self.qkv, self.att, hidden, 2 * self.inter * k, self.inter * k, hidden * k, self.experts]
            bo = np.zeros(N_BO, np.int64)
            offset = 0
            for j, size in enumerate(sizes):
                bo[j] = offset
                offset += -(-n * size // 16) * 16
            bo[BO_LAYER] = offset
            e = self.experts
            bo[BO_I_ACT], bo[BO_I_IDS] = e + 1, 2 * e + 1
            bo[BO_I_XS], bo[BO_I_OS], bo[BO_I_SIZE] = 2 * e + 1 + n * k, 2 * e + 1 + 2 * n * k, 2 * e + 1 + 3 * n * k
            held = (bo, np.zeros(offset * self.plan.lay.shape[0], np.float32))
            self._shared = {n: held}       # one batch size at a time: a batch changes its size rarely
        return held

    def run(self, x0: np.ndarray, caches: list[KVCache], positions: np.ndarray,
            source=None) -> tuple[np.ndarray, list[Routing]]:
        """The logits [B, V] of B tokens (embeddings x0 [B, hidden]), row b at positions[b] of caches[b] (prepared,
        not yet committed), and each expert layer's routing of the B rows, as the blocks report it.

        With streamed experts, `source` (the expert store) brings each layer's union in: a layer whose union is all
        in memory runs on; at another the call stops, and the union comes in `source.groups` (one read per expert,
        resident ones first), each group run by a call of its own. The store counts every streamed layer's union
        as one step."""
        plan, n = self.plan, len(caches)
        bo, shared = self._buffers(n)
        choice = self._threads[n]
        threads = choice.pick(numba.get_num_threads())
        tabs = [c.table_array() for c in caches]
        tables = np.zeros((n, max(t.size for t in tabs)), np.int32)    # as table_array gives them
        for b, t in enumerate(tabs):
            tables[b, :t.size] = t
        rot = plan._rotaries
        half = max(r.spec.dim // 2 for r in rot)
        cs = np.zeros((n, len(rot), 2, half), np.float32)
        for j, rotary in enumerate(rot):
            cos, sin = rotary.tables(positions)                              # [B, dim / 2]
            cs[:, j, 0, : cos.shape[1]], cs[:, j, 1, : sin.shape[1]] = cos, sin
        scr = -(-(plan.scratch + int(positions.max()) + 1) // 16) * 16
        per = 2 * n * plan.hidden + scr + TILE * self.cols
        priv = np.empty(threads * per, np.float32)
        logits = np.empty((n, plan.vocab), np.float32)
        ivs = np.empty(threads * int(bo[BO_I_SIZE]), np.int64)
        ws = np.empty(threads * n * self.slots, np.float32)
        rids = np.zeros((plan.lay.shape[0], n * self.slots), np.int64)
        rw = np.zeros((plan.lay.shape[0], n * self.slots), np.float32)
        chosen = np.zeros(plan.lay.shape[0], np.int64)
        steps = 1 + plan.lay.shape[0] * 7
        sync = np.zeros((steps + 1) * LINE, np.int64)
        g = plan.g.copy()
        g[fk.G_STEPS] = steps
        lay = plan.lay
        # an expert layer's steps run the experts chosen: at most E, at most B * K
        uses = [min(n * lay[i, fk.L_K], lay[i, fk.L_E]) if lay[i, fk.L_MOE] else 1 for i in range(lay.shape[0])]
        chunks = int(sum(lay[i, fk.L_QKV1] - lay[i, fk.L_QKV0] + n * (lay[i, fk.L_HKV] + lay[i, fk.L_H])
                         + lay[i, fk.L_O1] - lay[i, fk.L_O0] + (-(-lay[i, fk.L_E] // 16) if lay[i, fk.L_MOE] else 0)
                         + uses[i] * (-(-lay[i, fk.L_I] // lay[i, fk.L_ROWS_IN]) + -(-plan.hidden // lay[i, fk.L_ROWS_DOWN]))
                         for i in range(lay.shape[0])))
        done = np.zeros(chunks + plan.g[fk.G_HEAD1] - plan.g[fk.G_HEAD0], np.int64)
        kv = plan._kv_table(caches[0].pool)
        pos = np.ascontiguousarray(positions, np.int64)
        x0 = np.ascontiguousarray(x0, np.float32).reshape(-1)
        run = np.zeros(fk.RUN_SLOTS, np.int64)
        state = np.zeros(2 * n * plan.hidden, np.float32)
        pick = np.zeros(max(1, self.experts), np.int64)
        t0 = time.perf_counter()

        def call() -> None:
            sync[:] = 0
            done[:] = 0
            decode_batch(threads, plan.descs, plan.kquant, plan.items, lay, plan.lf, g, bo, plan.fpar, kv, tables, pos,
                         cs, plan.rms_eps, x0, shared, priv, per, scr, ivs, ws, rids, rw, chosen, logits.reshape(-1),
                         sync, done, run, state, plan._flat.copy(), pick)

        call()
        n_layers = lay.shape[0]
        done_to = 0                                      # streamed layers before this one are counted by the store
        while run[fk.RUN_EXIT] < n_layers:               # stopped for a streamed layer's union
            layer = int(run[fk.RUN_EXIT])
            done_to = plan.account_streamed(source, rids, done_to, layer, n)
            needed = plan.union(rids, layer, n)
            brought = 0
            run[fk.RUN_START], run[fk.RUN_RESUME] = layer, 1
            for group in source.groups(layer, needed):  # each stays in memory until the next is asked for
                pick[:] = 0
                for e, expert in group.items():
                    plan._bring_expert(layer, int(e), expert)
                    pick[int(e)] = 1
                brought += len(group)
                run[fk.RUN_LAST] = int(brought == len(needed))
                call()
            done_to = layer + 1
        if plan.streamed_layers:
            plan.account_streamed(source, rids, done_to, n_layers, n)
        choice.record(threads, time.perf_counter() - t0)
        routes = [Routing(i, rids[i, :n * k].reshape(n, k), rw[i, :n * k].reshape(n, k)) for i, k in plan.moe]
        if routes:
            count = self.reads.setdefault(n, [0, 0])
            count[0] += 1
            count[1] += int(chosen.sum())
        return logits, routes
