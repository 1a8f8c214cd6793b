"""The fused decode step of a batch: one token of each of B sequences through every layer in one parallel region.

B sequences decoding one token each could run B fused steps (engine/fused/kernel.py), each reading every weight
of the model. Here one step runs them all: each product reads a chunk of a matrix once for all B rows (the
tiled product of engine/kernels/matmul.py dequantizes each 4-row tile once, then runs it over the rows),
attention runs per row on its own cache rows and position, and each thread keeps its own copy of every row's
hidden state, as the single step does for one. It runs on all of numba's threads or on one, whichever ran steps of
the batch's size faster (as the single step chooses its threads).

Every number is computed by the functions the single step and the blocks call, on the same inputs (each product
element by the one fixed sequence of float32 operations the matmul contract gives for any count of tokens), so
each row's logits are bitwise those of its own single step. Taken: resident models of dense (SiLU-gated MLP)
layers that the single step runs; the others decode their sequences one fused step each, or in one pass of the
blocks.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numba
import numpy as np
from numba import njit, prange

from engine.fused import kernel as fk
from engine.fused.kernel import attend_chunk
from engine.fused.sync import LINE, atomic_load, atomic_store, spin_pause
from engine.kernels.experts import silu_rows
from engine.kernels.kquant import KQUANT_FLAG, kq_desc_rows
from engine.kernels.matmul import TILE, planes, quant_rows
from engine.kernels.rows import norm_row
from engine.kernels.simd import U64
from engine.kv import KVCache
from engine.tuning import BySize, ThreadChoice

if TYPE_CHECKING:
    from engine.fused.plan import FusedDecode

F32 = np.float32
# offsets of a layer's buffers in its slab of `shared` (bo [N_BO] int64), each holding B rows: q/k/v projections,
# attention heads, attention output, gate and up, their SiLU product, the MLP output; then the slab's size
BO_QKV, BO_ATT, BO_O, BO_GU, BO_HB, BO_Y, BO_LAYER, N_BO = range(8)


@njit(boundscheck=False)
def _product(desc, kquant, r0, r1, x, rows, out, ldo, col0, scratch):
    """Rows r0 .. r1 - 1 of the matrix `desc` describes times the B rows of x (flat [B, cols]) ->
    out[b * ldo + col0 + r - r0]: each weight tile read once for all rows, by the kernels the single step runs
    (kquant None: no matrix is a K-quant, and their kernels are not compiled)."""
    if kquant is not None:
        if desc[0] == KQUANT_FLAG:
            kq_desc_rows(desc, r0, r1 - r0, x, rows, rows, 0, rows.shape[0], out, ldo, col0)
            return
    bits, asym, group, _, cols, a, b, sc, mn = planes(desc)
    quant_rows(bits, asym, group, a, b, sc, mn, cols, r0, r1, x, rows, rows, 0, rows.shape[0], out, ldo, col0,
                   scratch)


@njit(boundscheck=False)
def _chunk(kind, c, l, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps, lb, h, scr, tile, rows,
           logits):
    """Chunk c of step `kind` of layer l for the batch (lb: the layer's slab; h, scr, tile: the thread's own)."""
    hidden, n_rows = g[fk.G_HIDDEN], rows.shape[0]
    d, dv = lay[l, fk.L_D], lay[l, fk.L_DV]
    qs = lay[l, fk.L_H] * d + lay[l, fk.L_HKV] * (d + dv)        # a row's q, k, v features
    att = lay[l, fk.L_H] * dv                                    # and attention heads
    if kind == fk.S_QKV:
        i = lay[l, fk.L_QKV0] + c
        _product(descs[items[i, 0]], kquant, items[i, 1], items[i, 2], h, rows, lb[bo[BO_QKV]:], qs, items[i, 3] + items[i, 1],
                 tile)
    elif kind == fk.S_O:
        i = lay[l, fk.L_O0] + c
        _product(descs[items[i, 0]], kquant, items[i, 1], items[i, 2], lb[bo[BO_ATT]:], rows, lb[bo[BO_O]:], hidden,
                 items[i, 3] + items[i, 1], tile)
    elif kind == fk.S_HEAD:
        i = g[fk.G_HEAD0] + c
        _product(descs[items[i, 0]], kquant, items[i, 1], items[i, 2], h, rows, logits, logits.shape[0] // n_rows,
                 items[i, 3] + items[i, 1], tile)
    elif kind == fk.S_KV or kind == fk.S_HEADS:     # kv or query head c % heads of row c // heads
        heads = lay[l, fk.L_HKV] if kind == fk.S_KV else lay[l, fk.L_H]
        b = c // heads
        attend_chunk(kind, c % heads, l, lay, lf, fpar, kvaddr, tables[b], pos[b], cs[b], eps,
                     lb[bo[BO_QKV] + b * qs:], lb[bo[BO_ATT] + b * att:], scr)
    elif kind == fk.S_GATE_UP:
        inter_ff, per_rows = lay[l, fk.L_I], lay[l, fk.L_ROWS_IN]
        r0 = c * per_rows
        r1 = min(inter_ff, r0 + per_rows)
        m0 = lay[l, fk.L_GATE]
        gu = lb[bo[BO_GU]:]
        for m in range(2):
            _product(descs[m0 + m], kquant, r0, r1, h, rows, gu, 2 * inter_ff, m * inter_ff + r0, tile)
        for b in range(n_rows):
            silu_rows(gu, U64(2 * b * inter_ff + r0), gu, U64((2 * b + 1) * inter_ff + r0), lb[bo[BO_HB]:],
                      U64(b * inter_ff + r0), r1 - r0)
    else:  # S_DOWN
        per_rows = lay[l, fk.L_ROWS_DOWN]
        r0 = c * per_rows
        r1 = min(hidden, r0 + per_rows)
        _product(descs[lay[l, fk.L_DOWN]], kquant, r0, r1, lb[bo[BO_HB]:], rows, lb[bo[BO_Y]:], hidden, r0, tile)


@njit(boundscheck=False)
def _step(kind, n, first, l, tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps, lb,
          h, scr, tile, rows, logits):
    """Run step `kind` of layer l (n chunks, flags done[first:first + n]) with the other threads, as the single
    step's `_step` does: own chunks first, then wait for the others', computing one whose owner is off the core."""
    for c in range(n * tid // threads, n * (tid + 1) // threads):
        if atomic_load(done, U64(first + c)) == 0:
            _chunk(kind, c, l, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps, lb, h, scr, tile, rows,
                   logits)
            atomic_store(done, U64(first + c), 1)
    for c in range(n - 1, -1, -1):
        spins = 0
        while atomic_load(done, U64(first + c)) == 0:
            if spins < fk.STEAL:
                spin_pause()
                spins += 1
            else:  # the same chunk again, the same bits
                _chunk(kind, c, l, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps, lb, h, scr, tile,
                       rows, logits)
                atomic_store(done, U64(first + c), 1)


@njit(boundscheck=False)
def _worker(tid, threads, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps, x0, shared, priv, per,
            scr_size, logits, sync, done):
    hidden, n_rows = g[fk.G_HIDDEN], pos.shape[0]
    po = tid * per
    x = priv[po:po + n_rows * hidden]                                 # this thread's copy of the hidden states
    h = priv[po + n_rows * hidden:po + 2 * n_rows * hidden]           # their normed inputs of the next products
    scr = priv[po + 2 * n_rows * hidden:po + 2 * n_rows * hidden + scr_size]   # attention scratch
    tile = priv[po + 2 * n_rows * hidden + scr_size:po + per]         # a dequantized tile of 4 rows
    rows = np.arange(n_rows)
    end = g[fk.G_STEPS] * LINE                                        # set when the call is done
    for i in range(n_rows * hidden):
        x[i] = x0[i]
    first = np.int64(0)                                               # not a literal 0: _step compiles once
    for l in range(g[fk.G_LAYERS]):
        if atomic_load(sync, U64(end)) != 0:
            return
        lb = shared[l * bo[BO_LAYER]:(l + 1) * bo[BO_LAYER]]
        for b in range(n_rows):
            norm_row(x, U64(b * hidden), fpar[lay[l, fk.L_IN_NORM]:], eps, hidden, h, U64(b * hidden))
        n = lay[l, fk.L_QKV1] - lay[l, fk.L_QKV0]
        _step(fk.S_QKV, n, first, l, tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs,
              eps, lb, h, scr, tile, rows, logits)
        first += n
        n = n_rows * lay[l, fk.L_HKV]
        _step(fk.S_KV, n, first, l, tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs,
              eps, lb, h, scr, tile, rows, logits)
        first += n
        n = n_rows * lay[l, fk.L_H]
        _step(fk.S_HEADS, n, first, l, tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos,
              cs, eps, lb, h, scr, tile, rows, logits)
        first += n
        n = lay[l, fk.L_O1] - lay[l, fk.L_O0]
        _step(fk.S_O, n, first, l, tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs,
              eps, lb, h, scr, tile, rows, logits)
        first += n
        o = lb[bo[BO_O]:]
        for i in range(n_rows * hidden):
            x[i] = x[i] + o[i]
        for b in range(n_rows):
            norm_row(x, U64(b * hidden), fpar[lay[l, fk.L_POST_NORM]:], eps, hidden, h, U64(b * hidden))
        n = (lay[l, fk.L_I] + lay[l, fk.L_ROWS_IN] - 1) // lay[l, fk.L_ROWS_IN]
        _step(fk.S_GATE_UP, n, first, l, tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos,
              cs, eps, lb, h, scr, tile, rows, logits)
        first += n
        n = (hidden + lay[l, fk.L_ROWS_DOWN] - 1) // lay[l, fk.L_ROWS_DOWN]
        _step(fk.S_DOWN, n, first, l, tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs,
              eps, lb, h, scr, tile, rows, logits)
        first += n
        y = lb[bo[BO_Y]:]
        for i in range(n_rows * hidden):
            x[i] = x[i] + y[i]
    for b in range(n_rows):
        norm_row(x, U64(b * hidden), fpar[g[fk.G_NORM]:], eps, hidden, h, U64(b * hidden))
    n = g[fk.G_HEAD1] - g[fk.G_HEAD0]
    _step(fk.S_HEAD, n, first, np.int64(0), tid, threads, done, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps,
          shared[:0], h, scr, tile, rows, logits)
    atomic_store(sync, U64(end), 1)


@njit(parallel=True, nogil=True, cache=True, boundscheck=False)
def decode_batch(threads, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps, x0, shared, priv, per,
                 scr_size, logits, sync, done):  # pragma: no cover - compiled
    """One token of each of B rows (embeddings x0 flat [B, hidden], row b at pos[b] of the cache blocks tables[b])
    through the layers -> logits flat [B, V] (see the module docstring)."""
    for tid in prange(threads):
        # int64: parfor types tid signed, then unsigned in its gufunc; one type compiles _worker once
        _worker(np.int64(tid), threads, descs, kquant, items, lay, lf, g, bo, fpar, kvaddr, tables, pos, cs, eps, x0, shared, priv, per,
                scr_size, logits, sync, done)


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
        self.cols = int(plan.descs[:, 4].max())                         # the widest matrix's columns
        self._shared: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # rows -> (bo, shared)
        # all of numba's threads, or one when steps with one were faster (other programs on the cores), per batch size
        self._threads: BySize[ThreadChoice] = BySize(ThreadChoice)

    @classmethod
    def for_plan(cls, plan: "FusedDecode | None") -> "BatchedDecode | None":
        """The batched step of a single step's plan, or None when some layer is not dense (experts) or streamed."""
        if plan is None or (plan.lay[:, fk.L_MOE] != 0).any() or plan.streamed_layers:
            return None
        return cls(plan)

    def accepts(self, caches: list[KVCache]) -> bool:
        """Whether these sequences' caches can run together: one pool of plain attention layers, no retention."""
        pool = caches[0].pool
        return all(c.pool is pool and not c.tracking for c in caches) and self.plan.accepts(caches[0])

    def _buffers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        held = self._shared.get(n)
        if held is None:
            hidden = self.plan.hidden
            sizes = [self.qkv, self.att, hidden, 2 * self.inter, self.inter, hidden]
            bo = np.zeros(N_BO, np.int64)
            offset = 0
            for k, size in enumerate(sizes):
                bo[k] = offset
                offset += -(-n * size // 16) * 16
            bo[BO_LAYER] = offset
            held = (bo, np.zeros(offset * self.plan.lay.shape[0], np.float32))
            self._shared = {n: held}       # one batch size at a time: a batch changes its size rarely
        return held

    def run(self, x0: np.ndarray, caches: list[KVCache], positions: np.ndarray) -> np.ndarray:
        """The logits [B, V] of B tokens (embeddings x0 [B, hidden]), row b at positions[b] of caches[b] (prepared,
        not yet committed)."""
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
        steps = 1 + plan.lay.shape[0] * 6
        sync = np.zeros((steps + 1) * LINE, np.int64)
        g = plan.g.copy()
        g[fk.G_STEPS] = steps
        lay = plan.lay
        chunks = int(sum(lay[i, fk.L_QKV1] - lay[i, fk.L_QKV0] + n * (lay[i, fk.L_HKV] + lay[i, fk.L_H])
                         + lay[i, fk.L_O1] - lay[i, fk.L_O0] + -(-lay[i, fk.L_I] // lay[i, fk.L_ROWS_IN])
                         + -(-plan.hidden // lay[i, fk.L_ROWS_DOWN]) for i in range(lay.shape[0])))
        done = np.zeros(chunks + plan.g[fk.G_HEAD1] - plan.g[fk.G_HEAD0], np.int64)
        kv = plan._kv_table(caches[0].pool)
        t0 = time.perf_counter()
        decode_batch(threads, plan.descs, plan.kquant, plan.items, lay, plan.lf, g, bo, plan.fpar, kv, tables,
                     np.ascontiguousarray(positions, np.int64), cs, plan.rms_eps,
                     np.ascontiguousarray(x0, np.float32).reshape(-1), shared, priv, per, scr, logits.reshape(-1),
                     sync, done)
        choice.record(threads, time.perf_counter() - t0)
        return logits
