"""The fused decode step in numba: one token through every layer in one parallel region.

Decoding one token through the blocks one call at a time costs a parallel region per product (each
waking the other threads) plus the Python between them. Here every thread runs the whole token
(`_worker`). Each product is a step cut into chunks (rows of one matrix, one attention head, one
expert's rows); each thread owns a contiguous share of a step's chunks and goes on once every chunk
of the step is done. The small work between products (norms, residual adds, routing) each thread
does for itself on its own copy of the hidden state: identical numbers, no waiting.

Every step writes its own buffer of the layer (nothing is overwritten within a token), so a thread
that falls behind still finds what it needs; and a chunk whose owner does not finish it within tens
of microseconds (the system took that thread's core away) is computed again by the waiting thread:
the same function on the same inputs, so the same bits, written over identical bits. No thread
ever waits for another to be scheduled, which is what a busy machine costs a lockstep kernel.

Every number is computed by the functions the batched blocks call (engine/kernels/matmul.py for the
products of Colibri's formats, engine/kernels/kquant.py for GGUF K-quant matrices, each matrix in its own type;
engine/kernels/rows.py and engine/kernels/attention.py for the rest), so the logits are
bitwise those of `Transformer.forward_batch` for the same token.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from engine.fused.post import MAX_GUESS, W_ALL, W_SOME, W_STOP
from engine.fused.sync import LINE, atomic_load, atomic_store, cycles, fence, spin_pause, wake, yield_cpu
from engine.kernels.attention import attend_row, encode_i8_row
from engine.kernels.experts import silu_rows
from engine.kernels.kquant import KQUANT_FLAG, kq_desc_rows
from engine.kernels.matmul import TILE, otf_rows, planes, tile_rows
from engine.kernels.rows import norm_row, norm_scale, rope_row, route_row
from engine.kernels.simd import U64, address_as_voidptr, f32_to_f16, fma32

F32 = np.float32
STEAL = 2000     # pauses (10-20 ns each) a thread waits for another's chunk before computing it itself
ISCR = 192       # int64 scratch per thread
# run [8 + K] int64, what a call does (streamed experts: engine/fused/plan.py): RUN_START the layer it starts at;
# RUN_RESUME 0 to start that layer from its input (x0 at layer 0, else `state`), 1 to resume at its experts;
# RUN_ACTIVE how many slots the experts step runs (listed from RUN_SLOTS); RUN_LAST 1 when these are the layer's
# last, so that the call goes on; RUN_EXIT (written) the layer whose streamed experts the call stopped for, or L.
RUN_START, RUN_RESUME, RUN_ACTIVE, RUN_EXIT, RUN_LAST, RUN_SLOTS = 0, 1, 2, 3, 4, 8
# post [PostLayout.size] int64 (engine/fused/post.py names its regions; their offsets are the G_P_* globals), what a
# call and the store's driver tell each other while it runs (G_POST 1; see engine/fused/driver.py, woken by a write
# to the eventfd G_WAKE after a post of needs; guesses wait for its next wake). cur [threads * LINE] int64: per
# thread, the streamed layer whose experts it may be reading (-1: none); the driver overwrites no expert of such a
# layer.
FLAG_COMING = 2     # flags: a streamed expert being read, published once in memory (with G_POST: the call waits)

# -- layout of the plan (engine/fused/plan.py builds it) -----------------------------------------
# lay [L, N_LAY] int64 per layer; lf [L, 2] float32 (attention scale, routing scale); g [N_G] int64 globals;
# kvaddr [L, 8] int64 per layer of the cache's pool: addresses of k, ks, v, vs, then block size, blocks and the
# bits of a stored key or value (32: float32, 16: fp16, 8: int8 with a float32 scale per row), then the address
# of the layer's attention weights [heads, pos + 1] float32 when the cache keeps them (retention), else 0.
# shared [L * g[G_LAYER]] float32: per layer q/k/v, attention heads, o, router logits, the read-ahead guess's
# router logits (of a later layer), gate/up, SiLU products and down outputs at the G_* offsets.
# priv [threads * g[G_PRIV]] float32: per thread x, h [hidden], then scratch [max(3D + positions, 2E + K)].
# iscr [threads * ISCR] int64: per thread token rows, expert slot, thread id and count, then (from 8) the chosen
# experts, then (from 64) the slots the expert steps run. sync [(steps + 1) * LINE] int64: the token's end at
# steps * LINE. done [chunks] int64.

(L_IN_NORM, L_POST_NORM, L_QKV0, L_QKV1, L_O0, L_O1, L_H, L_HKV, L_D, L_DV, L_ROT, L_ROPE_D, L_INTERLEAVED,
 L_WINDOW, L_MOE, L_E, L_K, L_I, L_ROUTER, L_SCORING, L_NORM_TOPK, L_BIAS, L_EXP0, L_GATE, L_DOWN,
 L_QKV_BIAS, L_QK_NORM, L_ROWS_IN, L_ROWS_DOWN, L_STREAMED, L_RES0, L_GUESS, L_QK_FULL, N_LAY) = range(34)
(G_HIDDEN, G_LAYERS, G_NORM, G_HEAD0, G_HEAD1, G_QKV, G_ATT, G_O, G_RL, G_GU, G_HB, G_Y, G_PRIV, G_STEPS,
 G_LAYER, G_AHEAD, G_GL, G_POST, G_FLAGW, G_WAKE, G_P_WORD, G_P_GUESSED, G_P_NEEDED, G_P_REFUSED, G_P_DECIDING,
 G_P_GUESS_IDS, G_P_NEED_IDS, G_P_MASK, G_P_SECOND, N_G) = range(30)
# kinds of step
S_QKV, S_KV, S_HEADS, S_O, S_ROUTER, S_GATE_UP, S_DOWN, S_HEAD = range(8)


@njit(boundscheck=False)
def _product(desc, kquant, r0, r1, x, xrows, orows, out, col0):
    """Rows r0 .. r1 - 1 of the matrix `desc` describes times one token (x row xrows[0]) -> out[orows[0] + col0 ..]:
    Colibri's formats by engine/kernels/matmul.py, GGUF K-quants by engine/kernels/kquant.py (the kernels the
    blocks run for either, so the same bits). kquant None: no matrix is a K-quant, and numba prunes (never types
    nor compiles) their kernels, a large share of the step's compile."""
    if kquant is not None:
        if desc[0] == KQUANT_FLAG:
            kq_desc_rows(desc, r0, r1 - r0, x, xrows, orows, 0, 1, out, 0, col0)
            return
    bits, asym, group, _, cols, a, b, sc, mn = planes(desc)
    otf_rows(bits, asym, group, a, b, sc, mn, cols, r0, r1 - r0, x, xrows, orows, 0, 1, out, 0, col0)


@njit(boundscheck=False)
def _item(descs, kquant, items, i, x, xrows, out):
    """Item i of the table: rows r0 .. r1 - 1 of matrix `mat` times x -> out[base + r]."""
    mat, r0, r1, base = items[i, 0], items[i, 1], items[i, 2], items[i, 3]
    _product(descs[mat], kquant, r0, r1, x, xrows[:1], xrows[1:], out, base + r0)


@njit
def _expert(lay, l, k, ids, direct):
    """Descriptor index of the gate matrix of slot k's expert (up and down follow): resident experts by their
    id; streamed ones by id among those in memory (`direct`: every one of the step's was) or else by slot (filled
    in for the call)."""
    if lay[l, L_STREAMED] == 0:
        return lay[l, L_EXP0] + 3 * ids[k]
    if direct:
        return lay[l, L_RES0] + 3 * ids[k]
    return lay[l, L_EXP0] + 3 * k


@njit(boundscheck=False)
def attend_chunk(kind, c, l, lay, lf, fpar, kvaddr, table, pos, cs, eps, qkv, att, scr):
    """Chunk c of step S_KV (kv head c of the token at `pos` into the cache rows `table` maps) or S_HEADS (query head
    c over them, into att[c * dv ..]) of layer l, from the token's q/k/v projections qkv."""
    n_heads, n_kv, d, dv = lay[l, L_H], lay[l, L_HKV], lay[l, L_D], lay[l, L_DV]
    q_out = n_heads * d
    rope_d, inter = lay[l, L_ROPE_D], lay[l, L_INTERLEAVED] != 0
    cos, sin = cs[lay[l, L_ROT], 0], cs[lay[l, L_ROT], 1]
    bsize, nb = kvaddr[l, 4], kvaddr[l, 5]
    half = kvaddr[l, 6] == 16                      # keys and values stored as fp16 bits,
    q8 = kvaddr[l, 6] == 8                         # or as int8 with a scale per row, else float32
    nk, nv = nb * n_kv * bsize * d, nb * n_kv * bsize * dv
    kb = numba.carray(address_as_voidptr(kvaddr[l, 0]), (0 if half or q8 else nk,), np.float32)
    vb = numba.carray(address_as_voidptr(kvaddr[l, 2]), (0 if half or q8 else nv,), np.float32)
    kh = numba.carray(address_as_voidptr(kvaddr[l, 0]), (nk if half else 0,), np.uint16)
    vh = numba.carray(address_as_voidptr(kvaddr[l, 2]), (nv if half else 0,), np.uint16)
    kq = numba.carray(address_as_voidptr(kvaddr[l, 0]), (nk if q8 else 0,), np.int8)
    vq = numba.carray(address_as_voidptr(kvaddr[l, 2]), (nv if q8 else 0,), np.int8)
    ks = numba.carray(address_as_voidptr(kvaddr[l, 1]), (nb * n_kv * bsize,), np.float32)
    vs = numba.carray(address_as_voidptr(kvaddr[l, 3]), (nb * n_kv * bsize,), np.float32)
    bias = lay[l, L_QKV_BIAS]                      # fpar offset of the q, k, v biases laid end to end, or -1
    qk_norm = lay[l, L_QK_NORM]                    # fpar offset of the per-head q then k norm weights, or -1
    qk_full = lay[l, L_QK_FULL] > 0                # instead one norm over all heads' q, one over all k (no biases)
    t1 = scr[d:2 * d]
    t2 = scr[2 * d:3 * d]
    o = q_out + c * d if kind == S_KV else c * d   # this head's q or k features
    for j in range(d):
        t1[j] = qkv[o + j] + fpar[bias + o + j] if bias >= 0 else qkv[o + j]
    src = t1
    if qk_full:
        # this head's slice of the whole projection's norm: the factor over all of q (or k), its own weights
        inv = norm_scale(qkv, U64(q_out if kind == S_KV else 0), eps, n_kv * d if kind == S_KV else q_out)
        for j in range(d):
            t2[j] = (t1[j] * inv) * fpar[qk_norm + o + j]
        src = t2
    elif qk_norm >= 0:
        norm_row(t1, U64(0), fpar[qk_norm + (d if kind == S_KV else 0):], eps, d, t2, U64(0))
        src = t2
    if kind == S_KV:
        # kv head c: its key biased, normed and rotated into the cache row of this position, its value beside it
        row = (U64(table[pos // bsize]) * U64(n_kv) + U64(c)) * U64(bsize) + U64(pos % bsize)
        vo = q_out + n_kv * d + c * dv
        if half:                                   # rounded to fp16 as the cache's numpy writer rounds
            kr = scr[:d]
            rope_row(src, U64(0), cos, sin, U64(0), rope_d, d, inter, kr, U64(0))
            for j in range(d):
                kh[row * U64(d) + U64(j)] = f32_to_f16(kr[j])
            for j in range(dv):
                vh[row * U64(dv) + U64(j)] = f32_to_f16(qkv[vo + j] + fpar[bias + vo + j] if bias >= 0
                                                        else qkv[vo + j])
        elif q8:                                   # each row scaled and rounded as the cache's numpy writer does
            kr = scr[:d]
            rope_row(src, U64(0), cos, sin, U64(0), rope_d, d, inter, kr, U64(0))
            ks[row] = encode_i8_row(kr, d, kq, row * U64(d))
            vr = scr[d:d + dv]
            for j in range(dv):
                vr[j] = qkv[vo + j] + fpar[bias + vo + j] if bias >= 0 else qkv[vo + j]
            vs[row] = encode_i8_row(vr, dv, vq, row * U64(dv))
        else:
            rope_row(src, U64(0), cos, sin, U64(0), rope_d, d, inter, kb, row * U64(d))
            for j in range(dv):
                vb[row * U64(dv) + U64(j)] = qkv[vo + j] + fpar[bias + vo + j] if bias >= 0 else qkv[vo + j]
        if not q8:
            ks[row] = F32(1.0)
            vs[row] = F32(1.0)
    else:
        # query head c over the cache (attend_row only stores its results: a chunk computed twice is harmless)
        qr = scr[:d]
        rope_row(src, U64(0), cos, sin, U64(0), rope_d, d, inter, qr, U64(0))
        window = lay[l, L_WINDOW]
        lo = pos - window + 1 if window > 0 and pos - window + 1 > 0 else 0
        keep = kvaddr[l, 7] != 0                   # the cache keeps each head's weights (retention)
        if q8:
            attend_row(qr, U64(0), d, kq, ks, vq, vs, n_kv, bsize, dv, c // (n_heads // n_kv), table, pos, lo,
                       lf[l, 0], scr[3 * d:], U64(0), keep, pos + 1, att, U64(c * dv))
        elif half:
            attend_row(qr, U64(0), d, kh, ks, vh, vs, n_kv, bsize, dv, c // (n_heads // n_kv), table, pos, lo,
                       lf[l, 0], scr[3 * d:], U64(0), keep, pos + 1, att, U64(c * dv))
        else:
            attend_row(qr, U64(0), d, kb, ks, vb, vs, n_kv, bsize, dv, c // (n_heads // n_kv), table, pos, lo,
                       lf[l, 0], scr[3 * d:], U64(0), keep, pos + 1, att, U64(c * dv))
        if keep:
            kept = numba.carray(address_as_voidptr(kvaddr[l, 7]), (n_heads * (pos + 1),), np.float32)
            for s in range(pos + 1):
                kept[c * (pos + 1) + s] = scr[3 * d + s]


@njit(boundscheck=False)
def _chunk(kind, c, l, descs, kquant, items, lay, lf, g, fpar, kvaddr, table, pos, cs, eps, lb, h, scr, ids, iscr, io,
           logits):
    """Chunk c of step `kind` of layer l (lb: the layer's shared buffers; h, scr, ids: the thread's own)."""
    hidden = g[G_HIDDEN]
    xrows = iscr[io:io + 2]
    if kind == S_QKV:
        _item(descs, kquant, items, lay[l, L_QKV0] + c, h, xrows, lb[g[G_QKV]:])
    elif kind == S_O:
        _item(descs, kquant, items, lay[l, L_O0] + c, lb[g[G_ATT]:], xrows, lb[g[G_O]:])
    elif kind == S_HEAD:
        _item(descs, kquant, items, g[G_HEAD0] + c, h, xrows, logits)
    elif kind == S_KV or kind == S_HEADS:
        attend_chunk(kind, c, l, lay, lf, fpar, kvaddr, table, pos, cs, eps, lb[g[G_QKV]:], lb[g[G_ATT]:], scr)
    elif kind == S_ROUTER:
        n_exp = lay[l, L_E]
        r = c * 16
        while r < min(n_exp, c * 16 + 16):             # 16 router rows per chunk, 4 at a time
            tile_rows(fpar[lay[l, L_ROUTER]:], U64(r) * U64(hidden), hidden, min(TILE, n_exp - r), h, xrows[:1],
                      xrows[:1], 0, 1, lb[g[G_RL]:], 0, r)
            r += TILE
    elif kind == S_GATE_UP:
        # rows r0 .. r1 of a gate and an up matrix (of slot k's expert, or the dense MLP), then their SiLU product
        inter_ff, rows = lay[l, L_I], lay[l, L_ROWS_IN]
        per = (inter_ff + rows - 1) // rows
        k = iscr[io + 64 + c // per]                   # the slot
        r0 = (c % per) * rows
        r1 = min(inter_ff, r0 + rows)
        m0 = _expert(lay, l, k, ids, iscr[io + 5] != 0) if lay[l, L_MOE] != 0 else lay[l, L_GATE]
        gu = lb[g[G_GU]:]
        for m in range(2):
            _product(descs[m0 + m], kquant, r0, r1, h, xrows[:1], xrows[1:], gu, (2 * k + m) * inter_ff + r0)
        silu_rows(gu, U64(2 * k * inter_ff + r0), gu, U64((2 * k + 1) * inter_ff + r0), lb[g[G_HB]:],
                  U64(k * inter_ff + r0), r1 - r0)
    else:  # S_DOWN: rows r0 .. r1 of slot k's down matrix times its SiLU product
        inter_ff, rows = lay[l, L_I], lay[l, L_ROWS_DOWN]
        per = (hidden + rows - 1) // rows
        k = iscr[io + 64 + c // per]
        r0 = (c % per) * rows
        r1 = min(hidden, r0 + rows)
        m = _expert(lay, l, k, ids, iscr[io + 5] != 0) + 2 if lay[l, L_MOE] != 0 else lay[l, L_DOWN]
        kr = iscr[io + 2:io + 3]                       # the SiLU product row this slot reads
        kr[0] = k
        _product(descs[m], kquant, r0, r1, lb[g[G_HB]:], kr, xrows[1:], lb[g[G_Y]:], k * hidden + r0)


@njit(boundscheck=False)
def _step(kind, n, step, first, l, sync, done, descs, kquant, items, lay, lf, g, fpar, kvaddr, table, pos, cs, eps, lb,
          h, scr, ids, iscr, io, logits):
    """Run step `kind` of layer l (n chunks, flags done[first:first + n]) with the other threads; return when all
    its chunks are done.

    Thread t of T owns the chunks n * t // T .. n * (t + 1) // T - 1 and runs them in order (no claiming: a
    shared claim counter and flags written by turns by both cores cost more per chunk than it saved),
    so its rows follow on from one chunk to the next and the prefetches run on. Then it waits for the others'
    chunks from the last back, computing one itself when it stays undone (its owner is off the core)."""
    tid, threads = iscr[io + 3], iscr[io + 4]
    for c in range(n * tid // threads, n * (tid + 1) // threads):
        if atomic_load(done, U64(first + c)) == 0:      # not already taken over by a waiting thread
            _chunk(kind, c, l, descs, kquant, items, lay, lf, g, fpar, kvaddr, table, pos, cs, eps, lb, h, scr, ids,
                   iscr, io, logits)
            atomic_store(done, U64(first + c), 1)
    for c in range(n - 1, -1, -1):
        spins = 0
        while atomic_load(done, U64(first + c)) == 0:
            if spins < STEAL:
                spin_pause()
                spins += 1
            else:  # its owner is off the core: the same chunk again, the same bits
                _chunk(kind, c, l, descs, kquant, items, lay, lf, g, fpar, kvaddr, table, pos, cs, eps, lb, h, scr, ids,
                       iscr, io, logits)
                atomic_store(done, U64(first + c), 1)


@njit(boundscheck=False)
def _await(l, top_k, ids, flags, fw, post, refused, tcycles):
    """Thread 0, its layer's reads asked for: wait until every expert of the step is in memory (W_ALL) or the
    driver says it cannot bring them (W_STOP: post[refused + l]), letting the reader and driver threads run
    meanwhile; that word and the cycles waited (also added to tcycles[3], the step's time waiting for reads)."""
    start = cycles()
    while True:
        word = W_ALL
        for k in range(top_k):
            if atomic_load(flags, U64(l * fw + ids[k])) != 1:
                word = 0
                break
        if word == 0 and atomic_load(post, U64(refused + l)) != 0:
            word = W_STOP
        if word != 0:
            waited = cycles() - start
            tcycles[3] += waited
            return word, waited
        yield_cpu()


@njit(boundscheck=False)
def _heard(post, idx):
    """Another thread: thread 0's word at post[idx], once written."""
    spins = 0
    word = atomic_load(post, U64(idx))
    while word == 0:
        if spins < STEAL:
            spin_pause()
            spins += 1
        else:
            yield_cpu()
        word = atomic_load(post, U64(idx))
    return word


@njit(boundscheck=False)
def _stop(l, x, h, state, hidden, cur, tid, run, sync, end):
    """The call stops at streamed layer l for the caller to bring its experts: x and h kept to resume there."""
    for i in range(hidden):
        state[i] = x[i]
        state[hidden + i] = h[i]
    atomic_store(cur, U64(tid * LINE), -1)
    run[RUN_EXIT] = l
    atomic_store(sync, U64(end), 1)


@njit(boundscheck=False)
def _worker(tid, threads, descs, kquant, items, lay, lf, g, fpar, kvaddr, table, pos, cs, eps, x0, shared, priv, iscr,
            rids, rw, logits, sync, done, tcycles, run, state, flags, post, cur):
    hidden = g[G_HIDDEN]
    po = tid * g[G_PRIV]
    x = priv[po:po + hidden]                            # this thread's copy of the hidden state
    h = priv[po + hidden:po + 2 * hidden]               # its normed input of the next products
    scr = priv[po + 2 * hidden:po + g[G_PRIV]]          # attention: q head, scratch, scores; routing: scores, weights
    io = tid * ISCR
    iscr[io] = 0                                        # [0, 0]: token 0 reads x row 0 and writes out row 0
    iscr[io + 1] = 0
    iscr[io + 3] = tid                                  # which chunks of each step are this thread's (_step)
    iscr[io + 4] = threads
    ids = iscr[io + 8:io + 64]                          # this token's experts (top_k <= 56)
    active = iscr[io + 64:io + 128]                     # the slots the expert steps run
    guess = iscr[io + 128:io + ISCR]                    # the experts guessed for a later layer
    end = g[G_STEPS] * LINE                             # set when the call is done: a thread behind stops
    layers, fw = g[G_LAYERS], g[G_FLAGW]
    p_word, p_guessed, p_needed, p_refused = g[G_P_WORD], g[G_P_GUESSED], g[G_P_NEEDED], g[G_P_REFUSED]
    p_guess_ids, p_need_ids, p_mask, p_second = g[G_P_GUESS_IDS], g[G_P_NEED_IDS], g[G_P_MASK], g[G_P_SECOND]
    start, resume = run[RUN_START], run[RUN_RESUME] != 0
    src = x0 if start == 0 and not resume else state
    for i in range(hidden):
        x[i] = src[i]
    step = np.int64(0)                                  # int64, not a literal 0: one compile of each step
    first = np.int64(0)
    mark = cycles()
    for l in range(start, g[G_LAYERS]):
        if atomic_load(sync, U64(end)) != 0:
            return
        lb = shared[l * g[G_LAYER]:(l + 1) * g[G_LAYER]]
        top_k, inter_ff = lay[l, L_K], lay[l, L_I]
        n_exp = lay[l, L_E]
        streamed = lay[l, L_STREAMED] != 0
        iscr[io + 5] = 0                                # 1: this layer's streamed experts are all in memory
        mask = 0                                        # with W_SOME: the slots whose experts were
        w = scr[2 * n_exp:2 * n_exp + top_k] if lay[l, L_MOE] != 0 else scr[:0]
        if resume and l == start:                       # this layer's attention and routing ran in an earlier call
            for i in range(hidden):
                h[i] = state[hidden + i]
            for k in range(top_k):
                ids[k] = rids[l, k]
                w[k] = rw[l, k]
        else:
            n_heads, n_kv = lay[l, L_H], lay[l, L_HKV]
            norm_row(x, U64(0), fpar[lay[l, L_IN_NORM]:], eps, hidden, h, U64(0))
            n = lay[l, L_QKV1] - lay[l, L_QKV0]
            _step(S_QKV, n, step, first, l, sync, done, descs, kquant, items, lay, lf, g, fpar, kvaddr, table, pos, cs,
                  eps, lb, h, scr, ids, iscr, io, logits)
            step, first = step + 1, first + n
            _step(S_KV, n_kv, step, first, l, sync, done, descs, kquant, items, lay, lf, g, fpar, kvaddr, table, pos,
                  cs, eps, lb, h, scr, ids, iscr, io, logits)
            step, first = step + 1, first + n_kv
            _step(S_HEADS, n_heads, step, first, l, sync, done, descs, kquant, items, lay, lf, g, fpar, kvaddr, table,
                  pos, cs, eps, lb, h, scr, ids, iscr, io, logits)
            step, first = step + 1, first + n_heads
            n = lay[l, L_O1] - lay[l, L_O0]
            _step(S_O, n, step, first, l, sync, done, descs, kquant, items, lay, lf, g, fpar, kvaddr, table, pos, cs,
                  eps, lb, h, scr, ids, iscr, io, logits)
            step, first = step + 1, first + n
            o = lb[g[G_O]:]
            for i in range(hidden):
                x[i] = x[i] + o[i]
            now = cycles()
            tcycles[0] += now - mark
            mark = now
            norm_row(x, U64(0), fpar[lay[l, L_POST_NORM]:], eps, hidden, h, U64(0))
            if lay[l, L_MOE] != 0:
                n = (n_exp + 15) // 16
                _step(S_ROUTER, n, step, first, l, sync, done, descs, kquant, items, lay, lf, g, fpar, kvaddr, table,
                      pos, cs, eps, lb, h, scr, ids, iscr, io, logits)
                step, first = step + 1, first + n
                bias = fpar[lay[l, L_BIAS]:lay[l, L_BIAS] + n_exp] if lay[l, L_BIAS] >= 0 else fpar[:0]
                route_row(lb[g[G_RL]:], U64(0), n_exp, top_k, lay[l, L_SCORING], bias, lay[l, L_NORM_TOPK] != 0,
                          lf[l, 1], scr, ids, U64(0), w, U64(0))
                for k in range(top_k):                  # every thread reports it (the same values): a thread
                    rids[l, k] = ids[k]                 # behind may stop before this layer
                    rw[l, k] = w[k]
                now = cycles()
                tcycles[1] += now - mark
                mark = now
                if streamed:
                    j = l + g[G_AHEAD]
                    direct = True
                    if g[G_POST] == 0:                  # every expert of the step in memory?
                        for k in range(top_k):
                            if flags[l * fw + ids[k]] != 1:
                                direct = False
                    if direct and g[G_AHEAD] > 0 and j < layers and lay[j, L_STREAMED] != 0 and \
                            lay[j, L_E] <= n_exp:
                        # and every expert layer j's router would pick from here (the read-ahead's guess)?
                        e_j, k_j = lay[j, L_E], lay[j, L_GUESS]
                        # layer j's router logits go to this layer's own guess buffer (written once a token, as
                        # every buffer: a thread behind that computes a chunk late writes the same values)
                        lbg = lb[g[G_GL] - g[G_RL]:]
                        h2 = scr[2 * n_exp + top_k + k_j:]
                        norm_row(x, U64(0), fpar[lay[j, L_POST_NORM]:], eps, hidden, h2, U64(0))
                        n = (e_j + 15) // 16
                        _step(S_ROUTER, n, step, first, j, sync, done, descs, kquant, items, lay, lf, g, fpar, kvaddr,
                              table, pos, cs, eps, lbg, h2, scr, ids, iscr, io, logits)
                        step, first = step + 1, first + n
                        bias_j = fpar[lay[j, L_BIAS]:lay[j, L_BIAS] + e_j] if lay[j, L_BIAS] >= 0 else fpar[:0]
                        route_row(lb[g[G_GL]:], U64(0), e_j, k_j, lay[j, L_SCORING], bias_j, lay[j, L_NORM_TOPK] != 0,
                                  lf[j, 1], scr, guess, U64(0), scr[2 * n_exp + top_k:], U64(0))
                        # With a driver: posted before this layer's needs, without waking it. It reads them ahead
                        # when it wakes, for these needs or a read. (Waking it for every guess with an expert not in
                        # memory cost more than its reads gained on two cores: many more wake-ups, no less io wait.)
                        if g[G_POST] != 0:
                            if tid == 0 and atomic_load(post, U64(p_guessed + j)) == 0:
                                ids0 = p_guess_ids + j * MAX_GUESS
                                for k in range(k_j):
                                    post[ids0 + k] = guess[k]
                                atomic_store(post, U64(p_guessed + j), k_j)
                        else:                           # the caller reads ahead where the call stops
                            for k in range(k_j):
                                if flags[j * fw + guess[k]] != 1:
                                    direct = False
                    if g[G_POST] != 0:                  # flags change while the call runs: thread 0 decides
                        atomic_store(cur, U64(tid * LINE), l)
                        fence()                         # (before any flag is read: see in_use)
                        if tid == 0:                    # (the words: see engine/fused/post.py)
                            atomic_store(post, U64(g[G_P_DECIDING]), l)
                            mask = 0
                            for k in range(top_k):
                                if atomic_load(flags, U64(l * fw + ids[k])) == 1:
                                    mask |= 1 << k
                            word = W_ALL if mask == (1 << top_k) - 1 else 0
                            if word == 0:               # the driver reads the others (or says it cannot)
                                ids0 = p_need_ids + l * MAX_GUESS
                                for k in range(top_k):
                                    post[ids0 + k] = ids[k]
                                atomic_store(post, U64(p_needed + l), top_k)
                                wake(g[G_WAKE], lay[l, L_K:L_K + 1])
                                if mask != 0:           # meanwhile the threads run those in memory
                                    post[p_mask + l] = mask
                                    word = W_SOME
                                else:
                                    word, waited = _await(l, top_k, ids, flags, fw, post, p_refused, tcycles)
                                    mark += waited      # (waiting for reads, not a phase of the layer)
                            atomic_store(post, U64(p_word + l), word)
                        else:
                            word = _heard(post, p_word + l)
                            if word == W_SOME:
                                mask = post[p_mask + l]
                        direct = word != W_STOP
                    if not direct:                      # the caller brings the experts in, then resumes here
                        _stop(l, x, h, state, hidden, cur, tid, run, sync, end)
                        return
                    iscr[io + 5] = 1
        slots = top_k if lay[l, L_MOE] != 0 else 1
        direct = iscr[io + 5] != 0
        if streamed and not direct:
            slots = run[RUN_ACTIVE]
            for k in range(slots):
                active[k] = run[RUN_SLOTS + k]
        elif mask != 0:                                 # those in memory first (each slot's output apart)
            slots = 0
            for k in range(top_k):
                if (mask >> k) & 1:
                    active[slots] = k
                    slots += 1
        else:
            for k in range(slots):
                active[k] = k
        for part in range(2 if mask != 0 else 1):
            if part == 1:                               # then the others, once read
                if tid == 0:
                    word, waited = _await(l, top_k, ids, flags, fw, post, p_refused, tcycles)
                    mark += waited
                    atomic_store(post, U64(p_second + l), word)
                else:
                    word = _heard(post, p_second + l)
                if word == W_STOP:
                    now = cycles()
                    tcycles[2] += now - mark
                    _stop(l, x, h, state, hidden, cur, tid, run, sync, end)
                    return
                slots = 0
                for k in range(top_k):
                    if not (mask >> k) & 1:
                        active[slots] = k
                        slots += 1
            n = slots * ((inter_ff + lay[l, L_ROWS_IN] - 1) // lay[l, L_ROWS_IN])
            _step(S_GATE_UP, n, step, first, l, sync, done, descs, kquant, items, lay, lf, g, fpar, kvaddr, table, pos,
                  cs, eps, lb, h, scr, ids, iscr, io, logits)
            step, first = step + 1, first + n
            n = slots * ((hidden + lay[l, L_ROWS_DOWN] - 1) // lay[l, L_ROWS_DOWN])
            _step(S_DOWN, n, step, first, l, sync, done, descs, kquant, items, lay, lf, g, fpar, kvaddr, table, pos, cs,
                  eps, lb, h, scr, ids, iscr, io, logits)
            step, first = step + 1, first + n
        if streamed and not direct and run[RUN_LAST] == 0:   # more of this layer's experts are still to come
            now = cycles()
            tcycles[2] += now - mark
            run[RUN_EXIT] = l
            atomic_store(sync, U64(end), 1)
            return
        y = lb[g[G_Y]:]
        if streamed and direct:                         # done with the layer's experts (their chunks all ran)
            atomic_store(cur, U64(tid * LINE), -1)
        if lay[l, L_MOE] != 0:
            for i in range(hidden):                     # the slots' outputs weighted in order (quant.weighted_sum)
                acc = F32(0.0)
                for k in range(top_k):
                    acc = fma32(w[k], y[k * hidden + i], acc)
                x[i] = x[i] + acc
            now = cycles()
            tcycles[2] += now - mark
        else:
            for i in range(hidden):
                x[i] = x[i] + y[i]
            now = cycles()
            tcycles[1] += now - mark
        mark = now
    norm_row(x, U64(0), fpar[g[G_NORM]:], eps, hidden, h, U64(0))
    n = g[G_HEAD1] - g[G_HEAD0]
    _step(S_HEAD, n, step, first, np.int64(0), sync, done, descs, kquant, items, lay, lf, g, fpar, kvaddr, table, pos, cs, eps,
          shared[:0], h, scr, ids, iscr, io, logits)
    run[RUN_EXIT] = g[G_LAYERS]
    atomic_store(sync, U64(end), 1)
    tcycles[1] += cycles() - mark


@njit(parallel=True, nogil=True, cache=True, boundscheck=False)
def decode_step(threads, descs, kquant, items, lay, lf, g, fpar, kvaddr, table, pos, cs, eps, x0, shared, priv, iscr,
                rids, rw, logits, sync, done, tcycles, run, state, flags, post, cur):  # pragma: no cover - compiled
    """One token through the layers (see the module docstring and `run`); logits [V] written once the last layer
    ran, routing in rids/rw [L, K]; x and h [2 * hidden] in `state` where a call stops for streamed experts.
    flags [L * G_FLAGW]: 1 where a streamed expert is in memory (its descriptors at L_RES0); a streamed layer whose
    experts all are runs on without stopping. Without G_POST, so must the experts guessed for the layer G_AHEAD on
    (the caller reads them ahead where the call stops); with it, the guesses go to `post` for a thread that reads
    them while the call runs on, and flags may change meanwhile (`cur`, `set_flag`, `in_use`). kquant: True when
    a matrix of descs is a GGUF K-quant or IQ4, else None (a variant compiled and cached without their kernels)."""
    for tid in prange(threads):
        # int64: parfor types tid signed, then unsigned in its gufunc; one type compiles _worker once
        _worker(np.int64(tid), threads, descs, kquant, items, lay, lf, g, fpar, kvaddr, table, pos, cs, eps, x0, shared, priv,
                iscr, rids, rw, logits, sync, done, tcycles[4 * tid:4 * tid + 4], run, state, flags, post, cur)
