"""The fused decode step's plan: a model's weights as the tables engine/fused/kernel.py reads.

`FusedDecode.for_model` accepts the common decoder shape: pre-norm layers (RMSNorm) of grouped-query attention
(q/k/v biases, per-head q/k norms or, without biases, whole-projection ones, any RoPE, sliding windows included;
no soft-capping), a SiLU-gated MLP without biases or a MoE routed by softmax or sigmoid without expert groups or
shared experts, an output head without a bias, every matrix quantized (Colibri's formats or GGUF K-quants, each
matrix in its own type), the experts
resident or streamed by an expert store (a container's K-quant experts too, kept as published; FP8 and MXFP4 experts
run through the blocks). The KV cache may hold float32, fp16 or int8 rows and keep
attention weights for retention. Anything else (a step of several tokens of a sequence, a probe)
runs through `Transformer.forward_batch` one block at a time; both give the same bits for the same
token.

With streamed experts (pread mode, Linux) a token runs in one call as a rule. While it runs, a
driver thread (engine/fused/driver.py) owns the store: thread 0 of the call posts the experts a layer lacks and
waits where it is until the driver has read them in (`ExpertStore.need`); it posts the read-ahead's
guess of a later layer's experts, which the driver hands to `prefetch` when it next wakes (for a need or a
completed read: a guess alone does not wake it); each read is published as it completes (`_held`:
descriptors, then the expert's flag), by its reader thread where its slot's tensors are laid out already, else
by the driver (see `ReadQueue` in engine/offload/reads.py). The driver takes slots only
from experts of layers the call has passed, and does not read over an expert while a thread of the
call may still be reading it (`engine.fused.sync.in_use`). Where the driver cannot bring a layer's
experts (no slot to be had yet) the call stops there and the engine thread brings them through
`ExpertStore.groups`: in groups as their reads finish, each group run by a call of its own; as
every call does without a driver (mmap mode, other systems).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np

from engine.blocks.attention import Attention
from engine.blocks.deltanet import GatedDeltaNet
from engine.blocks.ffn import MLP, MoE, ResidentExperts, Routing, StreamingExpertSource
from engine.blocks.kda import KimiDeltaAttention
from engine.errors import GenerationError
from engine.fused import kernel as fk
from engine.fused.driver import Driver
from engine.fused.post import MAX_GUESS, PostLayout
from engine.fused.sync import in_use, set_flag
from engine.kernels.kquant import KQUANT_FLAG
from engine.kernels.rows import SIGMOID, SOFTMAX
from engine.kv import KVCache, KVPool
from engine.quant.kquant import KQUANT_META_KIND, KQuantTensor
from engine.quant.tensor import META_KIND as QUANT_META_KIND
from engine.quant.tensor import QuantizedTensor
from engine.telemetry import Telemetry
from engine.tuning import ThreadChoice

CHUNK_WEIGHTS = 1 << 19   # at most this many weights per chunk of a product (tens of microseconds of one thread)
MAX_TOP_K = 56      # experts per token the kernel's integer scratch holds
ALIGN = 16          # float32 offsets of the shared buffers, multiples of this (64-byte lines)


@dataclass(frozen=True)
class FusedStep:
    """What one fused step returns besides its logits: its routing and the phase split of its wall time."""

    ids: np.ndarray               # [L, K] experts chosen per layer (rows of MoE layers)
    weights: np.ndarray           # [L, K] their weights
    moe: tuple[tuple[int, int], ...]   # (layer, top_k) of each MoE layer
    seconds: dict[str, float]     # attention, dense, experts
    attention: list[np.ndarray] | None = None   # each layer's attention weights [heads, pos + 1] (retention)

    def routing(self) -> list[Routing]:
        """Each MoE layer's routing, as the blocks report it."""
        return [Routing(i, self.ids[i : i + 1, :k], self.weights[i : i + 1, :k]) for i, k in self.moe]


def chunk_rows(cols: int, rows: int) -> int:
    """Rows per chunk of a matrix [rows, cols]: at most CHUNK_WEIGHTS weights and half the rows, a multiple of
    the 4-row tile.

    Large chunks: each costs its thread a little time to start, so fewer and larger chunks decode a token faster.
    At least two per matrix, so
    that a step of one or a few matrices still splits between two threads."""
    half = -(-rows // 2)
    return max(4, min(CHUNK_WEIGHTS // cols, -(-half // 4) * 4) // 4 * 4)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class FusedDecode:
    """A model's decode step in one parallel region (see engine/fused/kernel.py)."""

    def __init__(self, model) -> None:
        spec = model.spec
        if (spec.embedding_multiplier, spec.residual_multiplier, spec.logits_scaling) != (1.0, 1.0, 1.0):
            raise _NotFusable("embedding, residual or logits multipliers")
        if spec.norm != "rms" or model.lm_head_bias is not None:
            raise _NotFusable("LayerNorm or an output-head bias")
        self.hidden = spec.hidden_size
        self._descs: list[tuple[int, ...]] = []
        self._items: list[tuple[int, int, int, int]] = []
        self._fpar: list[np.ndarray] = []
        self._fsize = 0
        self._rotaries: list = []
        lay = np.full((spec.n_layers, fk.N_LAY), -1, np.int64)
        lay[:, fk.L_STREAMED] = 0
        lf = np.zeros((spec.n_layers, 2), np.float32)
        sizes = {"qkv": 0, "att": 0, "rl": 0, "gl": 0, "gu": 0, "hb": 0, "y": self.hidden, "scr": 0}
        self.top_k = 0
        self._moe: list[tuple[int, int]] = []
        if spec.final_softcap is not None:
            raise _NotFusable("soft-capped logits")
        for i, layer in enumerate(model.layers):
            if not layer.plain:
                raise _NotFusable("norms after the blocks or no norm before them")
            self._attention(i, layer, lay, lf, sizes)
            self._ffn(i, layer.ffn, model.experts, lay, lf, sizes)
        self.moe = tuple(self._moe)
        self.head0 = len(self._items)
        self._rows(self._matrix(model.lm_head), 0)
        g = np.zeros(fk.N_G, np.int64)
        g[fk.G_HIDDEN], g[fk.G_LAYERS] = self.hidden, spec.n_layers
        g[fk.G_NORM] = self._param(model.norm)
        g[fk.G_HEAD0], g[fk.G_HEAD1] = self.head0, len(self._items)
        offset = 0                                       # each layer's own buffers (see engine/fused/kernel.py)
        for name, key in (("qkv", fk.G_QKV), ("att", fk.G_ATT), ("o", fk.G_O), ("rl", fk.G_RL), ("gl", fk.G_GL),
                          ("gu", fk.G_GU), ("hb", fk.G_HB), ("y", fk.G_Y)):
            g[key] = offset
            offset += _aligned(sizes.get(name, self.hidden))
        g[fk.G_LAYER] = offset
        self.g, self.lay, self.lf = g, lay, lf
        self.scratch = sizes["scr"]                                       # per thread, beside positions
        self.vocab = model.lm_head.shape[0]
        self.descs = np.array(self._descs, np.int64)
        # None: no matrix is a GGUF K-quant or IQ4 (held, or streamed in by the store), and the step compiles (and
        # caches) without their kernels
        held_kquant = bool(self.descs.size and (self.descs[:, 0] == KQUANT_FLAG).any())
        streamed = not isinstance(model.experts, ResidentExperts) and _kquant_store(model.experts)
        self.kquant = True if held_kquant or streamed else None
        self.items = np.array(self._items, np.int64)
        self.fpar = np.concatenate(self._fpar) if self._fpar else np.zeros(0, np.float32)
        self.shared = np.zeros(offset * spec.n_layers, np.float32)
        self.steps, self.chunks = 0, 0                                  # steps and chunks of a token
        for i in range(spec.n_layers):
            slots = lay[i, fk.L_K] if lay[i, fk.L_MOE] else 1
            parts = [lay[i, fk.L_QKV1] - lay[i, fk.L_QKV0], lay[i, fk.L_HKV], lay[i, fk.L_H], lay[i, fk.L_O1] - lay[i, fk.L_O0],
                     slots * -(-lay[i, fk.L_I] // lay[i, fk.L_ROWS_IN]), slots * -(-self.hidden // lay[i, fk.L_ROWS_DOWN])]
            if lay[i, fk.L_MOE]:
                parts.append(-(-lay[i, fk.L_E] // 16))
            if lay[i, fk.L_STREAMED]:                   # the read-ahead guess for a later layer
                parts.append(-(-int(lay[:, fk.L_E].max()) // 16))
            self.steps += len(parts)
            self.chunks += int(sum(parts))
        self.steps += 1
        self.chunks += len(self._items) - self.head0
        g[fk.G_STEPS] = self.steps
        self.rms_eps = np.float32(spec.rms_eps)
        self._kv: dict[int, tuple[KVPool, np.ndarray]] = {}             # descriptors stay valid: the model holds the tensors
        self._exp0 = [int(v) for v in lay[:, fk.L_EXP0]]                # per layer, for _bring
        self._i_ff = [int(v) for v in lay[:, fk.L_I]]
        self._res0 = [int(v) for v in lay[:, fk.L_RES0]]
        self.flags = np.zeros((spec.n_layers, max(1, int(lay[:, fk.L_E].max()))), np.int64)   # see _held
        self._flat = self.flags.reshape(-1)                             # the same memory, as the kernel reads it
        g[fk.G_FLAGW] = self.flags.shape[1]
        self.layout = PostLayout(spec.n_layers)                         # what a call and its driver tell each other
        self.post = np.zeros(self.layout.size, np.int64)
        for key, at in ((fk.G_P_WORD, self.layout.word), (fk.G_P_GUESSED, self.layout.guessed),
                        (fk.G_P_NEEDED, self.layout.needed), (fk.G_P_REFUSED, self.layout.refused),
                        (fk.G_P_DECIDING, self.layout.deciding), (fk.G_P_GUESS_IDS, self.layout.guess_ids(0)),
                        (fk.G_P_NEED_IDS, self.layout.need_ids(0)), (fk.G_P_MASK, self.layout.mask),
                        (fk.G_P_SECOND, self.layout.second)):
            g[key] = at
        self.cur = np.full(max(1, numba.config.NUMBA_NUM_THREADS) * fk.LINE, -1, np.int64)
        self.driver: Driver | None = None                              # reads for a call while it runs
        self.streamed_layers = [i for i in range(spec.n_layers) if lay[i, fk.L_STREAMED]]
        self._extra: int | None = None
        self._threads = ThreadChoice()

    # --- building ---

    def _matrix(self, w) -> int:
        if not isinstance(w, (QuantizedTensor, KQuantTensor)):     # a GGUF K-quant runs in its own type
            raise _NotFusable("a float32 matrix")
        self._descs.append(w.descriptor)
        return len(self._descs) - 1

    def _rows(self, m: int, base: int) -> tuple[int, int]:
        """Items of matrix m in chunks of rows writing at base; their index range."""
        first = len(self._items)
        n = int(self._descs[m][3])
        rows = chunk_rows(int(self._descs[m][4]), n)
        for r0 in range(0, n, rows):
            self._items.append((m, r0, min(n, r0 + rows), base))
        return first, len(self._items)

    def _param(self, a: np.ndarray) -> int:
        a = np.ascontiguousarray(a, np.float32).reshape(-1)
        at = self._fsize
        pad = _aligned(a.size) - a.size
        self._fpar += [a, np.zeros(pad, np.float32)]
        self._fsize += a.size + pad
        return at

    def _attention(self, i: int, layer, lay: np.ndarray, lf: np.ndarray, sizes: dict) -> None:
        attn = layer.attn
        if isinstance(attn, GatedDeltaNet):
            raise _NotFusable("gated DeltaNet (a recurrent state the kernel does not keep)")
        if isinstance(attn, KimiDeltaAttention):
            raise _NotFusable("Kimi delta attention (a recurrent state the kernel does not keep)")
        if type(attn) is not Attention:
            raise _NotFusable("latent attention")
        s = attn.spec
        if attn.bo is not None or s.clip_qkv is not None or s.qk_norm not in (None, "head", "full") or s.sinks \
                or s.softcap is not None or (s.qk_norm == "full" and attn.bq is not None):
            raise _NotFusable("an output bias, q/k clipping, whole-projection q/k norms after biases, attention sinks "
                              "or soft-capped scores")
        if s.output_gate:
            raise _NotFusable("a gated attention output")
        q_out, kv_out = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        mq, mk, mv = self._matrix(attn.wq), self._matrix(attn.wk), self._matrix(attn.wv)
        lay[i, fk.L_QKV0] = self._rows(mq, 0)[0]
        self._rows(mk, q_out)
        lay[i, fk.L_QKV1] = self._rows(mv, q_out + kv_out)[1]
        lay[i, fk.L_O0], lay[i, fk.L_O1] = self._rows(self._matrix(attn.wo), 0)
        if attn.rotary not in self._rotaries:
            self._rotaries.append(attn.rotary)
        rope = attn.rotary.spec
        lay[i, fk.L_IN_NORM], lay[i, fk.L_POST_NORM] = self._param(layer.input_norm), self._param(layer.post_norm)
        lay[i, fk.L_H], lay[i, fk.L_HKV], lay[i, fk.L_D], lay[i, fk.L_DV] = s.n_heads, s.n_kv_heads, s.head_dim, s.head_dim
        lay[i, fk.L_ROT], lay[i, fk.L_ROPE_D] = self._rotaries.index(attn.rotary), rope.dim
        lay[i, fk.L_INTERLEAVED], lay[i, fk.L_WINDOW] = int(rope.interleaved), int(s.sliding_window or 0)
        if attn.bq is not None:
            lay[i, fk.L_QKV_BIAS] = self._param(np.concatenate([attn.bq, attn.bk, attn.bv]))
        if s.qk_norm is not None:               # per head: [D] then [D]; whole projection: [H*D] then [Hkv*D]
            lay[i, fk.L_QK_NORM] = self._param(np.concatenate([attn.q_norm, attn.k_norm]))
            lay[i, fk.L_QK_FULL] = int(s.qk_norm == "full")
        lf[i, 0] = np.float32(s.scale)
        sizes["qkv"] = max(sizes["qkv"], q_out + 2 * kv_out)
        sizes["att"] = max(sizes["att"], q_out)
        sizes["scr"] = max(sizes["scr"], 4 * s.head_dim)

    def _ffn(self, i: int, ffn, experts, lay: np.ndarray, lf: np.ndarray, sizes: dict) -> None:
        if isinstance(ffn, MLP):
            if ffn.spec.act not in ("silu", "swish"):
                raise _NotFusable(f"activation {ffn.spec.act}")
            w = ffn.weights
            if w.gate_bias is not None:
                raise _NotFusable("MLP biases")
            lay[i, fk.L_MOE], lay[i, fk.L_I] = 0, w.gate.shape[0]
            lay[i, fk.L_ROWS_IN] = chunk_rows(self.hidden, w.gate.shape[0])
            lay[i, fk.L_ROWS_DOWN] = chunk_rows(w.gate.shape[0], self.hidden)
            lay[i, fk.L_GATE] = self._matrix(w.gate)
            self._matrix(w.up)                                            # right after gate: L_GATE + 1
            lay[i, fk.L_DOWN] = self._matrix(w.down)
            sizes["gu"] = max(sizes["gu"], 2 * w.gate.shape[0])
            sizes["hb"] = max(sizes["hb"], w.gate.shape[0])
            return
        streamed = not isinstance(experts, ResidentExperts)
        if not isinstance(ffn, MoE) or (streamed and not _quantized_store(experts)):
            raise _NotFusable("experts not quantized")
        m = ffn.spec
        if m.n_group != 1 or m.scoring not in ("softmax", "sigmoid") or ffn.shared is not None or \
                m.act not in ("silu", "swish") or m.top_k > MAX_TOP_K or m.norm_min:
            raise _NotFusable("expert groups, another scoring, shared experts, another activation or a norm floor")
        if m.router_bias or m.expert_bias or m.swiglu_limit is not None:
            raise _NotFusable("a router bias, expert biases or the clamped SwiGLU")
        lay[i, fk.L_MOE], lay[i, fk.L_E], lay[i, fk.L_K], lay[i, fk.L_I] = 1, m.n_experts, m.top_k, m.expert_ffn
        lay[i, fk.L_ROWS_IN] = chunk_rows(self.hidden, m.expert_ffn)
        lay[i, fk.L_ROWS_DOWN] = chunk_rows(m.expert_ffn, self.hidden)
        lay[i, fk.L_EXP0] = len(self._descs)
        if streamed:                  # a row per slot, filled in per call (_bring), then one per expert in memory
            lay[i, fk.L_STREAMED] = 1
            self._descs += [(0,) * len(self._descs[0])] * (3 * m.top_k)
            lay[i, fk.L_RES0] = len(self._descs)
            self._descs += [(0,) * len(self._descs[0])] * (3 * m.n_experts)
            lay[i, fk.L_GUESS] = guessed(m.top_k, m.n_experts, None)
            sizes["gl"] = max(sizes["gl"], m.n_experts)
            sizes["scr"] = max(sizes["scr"], 2 * m.n_experts + m.top_k + MAX_GUESS + self.hidden)
        else:
            for e in experts.per_layer[i]:
                if e.gate.shape != (m.expert_ffn, self.hidden) or e.down.shape != (self.hidden, m.expert_ffn):
                    raise _NotFusable("experts of another shape")
                self._matrix(e.gate), self._matrix(e.up), self._matrix(e.down)
        lay[i, fk.L_ROUTER] = self._param(ffn.router)
        lay[i, fk.L_SCORING] = SOFTMAX if m.scoring == "softmax" else SIGMOID
        lay[i, fk.L_NORM_TOPK] = int(m.norm_topk_prob)
        lay[i, fk.L_BIAS] = self._param(ffn.correction_bias) if ffn.correction_bias is not None else -1
        lf[i, 1] = np.float32(m.routed_scaling_factor)
        self.top_k = max(self.top_k, m.top_k)
        self._moe.append((i, m.top_k))
        sizes["rl"] = max(sizes["rl"], m.n_experts)
        sizes["gu"] = max(sizes["gu"], 2 * m.top_k * m.expert_ffn)
        sizes["hb"] = max(sizes["hb"], m.top_k * m.expert_ffn)
        sizes["y"] = max(sizes["y"], m.top_k * self.hidden)
        sizes["scr"] = max(sizes["scr"], 2 * m.n_experts + m.top_k)

    @classmethod
    def for_model(cls, model) -> "FusedDecode | None":
        """The plan of a model, or None when some layer is not of the shape the kernel runs."""
        if model.layer_source is not None or any(layer is None for layer in model.layers):
            return None
        try:
            plan = cls(model)
        except _NotFusable:
            return None
        streaming = isinstance(model.experts, StreamingExpertSource)
        if plan.streamed_layers and streaming and model.experts.add_listener(plan._held) \
                and hasattr(os, "eventfd"):             # (Linux: elsewhere calls stop to read ahead, as before)
            plan.driver = Driver(plan, model.experts)
            plan.g[fk.G_WAKE] = plan.driver.fd
        return plan

    def _held(self, key: tuple[int, int], expert) -> None:
        """The store's word on a streamed expert: in memory to stay (its descriptors written, flagged) or gone.

        Called by the driver while a call runs too: an expert leaving is unflagged first, then its memory is
        not handed back (to be read over) while a thread of the call may still be reading it."""
        layer, e = key
        if layer not in self.streamed_layers:
            return
        idx = layer * self.flags.shape[1] + e
        if isinstance(expert, str):                     # its read started (READING): a call waits for it
            if self.flags[layer, e] == 0:
                set_flag(self._flat, idx, fk.FLAG_COMING)
            return
        if expert is None:
            flag = int(self.flags[layer, e])
            if flag == fk.FLAG_COMING:                  # its read failed: a call waiting for it stops there
                set_flag(self._flat, idx, 0)
                set_flag(self.post, self.layout.refused + layer, 1)
            elif flag:                                  # (the driver asked `_release` first; between calls no
                set_flag(self._flat, idx, 0)            # thread is at any layer)
                while in_use(self.cur, len(self.cur) // fk.LINE, layer):
                    time.sleep(20e-6)
            return
        row = self._res0[layer] + 3 * e
        i_ff = self._i_ff[layer]
        for m, w in enumerate((expert.gate, expert.up, expert.down)):
            want = (self.hidden, i_ff) if m == 2 else (i_ff, self.hidden)
            if not isinstance(w, (QuantizedTensor, KQuantTensor)) or w.shape != want:
                set_flag(self._flat, idx, 0)            # the calls bring it as they go (_bring says what is wrong)
                return
            self.descs[row + m] = w.descriptor_row
        set_flag(self._flat, idx, 1)                    # after its descriptors

    # --- running ---

    @property
    def tries(self) -> int:
        """Steps run on the thread count not chosen, to measure it (see FasterChoice.tries)."""
        return self._threads.tries

    def accepts(self, cache: KVCache) -> bool:
        """Whether a step on this cache can be fused: plain (not latent) attention layers (any KV width)."""
        return not any(cache.pool.latent)

    def _kv_table(self, pool: KVPool) -> np.ndarray:
        """[L, 8] addresses of each layer's k, ks, v, vs arrays, the block size, the block count and the bits (the
        last column, where attention weights go, 0)."""
        held = self._kv.get(id(pool))
        if held is None or held[0] is not pool:
            table = np.array([[a["k"].ctypes.data, a["ks"].ctypes.data, a["v"].ctypes.data, a["vs"].ctypes.data,
                               pool.block_size, pool.n_blocks, pool.bits, 0] for a in pool.layers], np.int64)
            held = (pool, table)
            self._kv = {id(pool): held}
        return held[1]

    def run(self, x0: np.ndarray, cache: KVCache, pos: int, source=None,
            predict: Callable[[int, np.ndarray], None] | None = None, ahead: int = 0,
            extra: int | None = None) -> tuple[np.ndarray, FusedStep]:
        """The logits [1, V] of the token whose embedding is x0 [hidden] at position pos (its row of `cache`
        prepared, not yet committed), with its routing and phase times.

        With streamed experts, `source` (the expert store) brings each layer's experts in, and
        `predict(layer, x)` is called where a call stops at `layer` with its hidden state x [hidden] (after
        attention), to start the reads of later layers. A streamed layer whose experts are all in memory (and the
        `ahead`-th layer's guessed ones too, `extra` beyond its top-k) runs on without stopping; the store counts
        it afterwards, in order (`ExpertStore.account_steps`)."""
        self.g[fk.G_AHEAD] = ahead if predict is not None else 0
        driver = self.driver if predict is not None and source is not None else None
        self.g[fk.G_POST] = int(driver is not None)
        if driver is not None:
            self.post[:] = 0                             # nothing guessed or asked for yet this token
            driver.token()
        if extra != self._extra:
            self._extra = extra
            for i in self.streamed_layers:
                self.lay[i, fk.L_GUESS] = guessed(int(self.lay[i, fk.L_K]), int(self.lay[i, fk.L_E]), extra)
        threads = self._threads.pick(numba.get_num_threads())
        cs = np.zeros((len(self._rotaries), 2, max(r.spec.dim // 2 for r in self._rotaries)), np.float32)
        p = np.array([pos], np.int64)
        for j, rotary in enumerate(self._rotaries):
            cos, sin = rotary.tables(p)
            cs[j, 0, : cos.shape[1]], cs[j, 1, : sin.shape[1]] = cos[0], sin[0]
        per = 2 * self.hidden + _aligned(max(self.scratch, self.scratch + pos + 1))
        self.g[fk.G_PRIV] = per
        priv = np.empty(threads * per, np.float32)
        iscr = np.zeros(threads * fk.ISCR, np.int64)
        k = max(self.top_k, 1)
        rids = np.zeros((self.lay.shape[0], k), np.int64)
        rw = np.zeros((self.lay.shape[0], k), np.float32)
        logits = np.empty((1, self.vocab), np.float32)
        tcycles = np.zeros(4 * threads, np.int64)
        run = np.zeros(fk.RUN_SLOTS + MAX_TOP_K, np.int64)
        state = np.zeros(2 * self.hidden, np.float32)
        x0 = np.ascontiguousarray(x0, np.float32).reshape(-1)
        kv, table = self._kv_table(cache.pool), cache.table_array()
        kept = None
        if cache.tracking:                               # each head's attention weights, for the retention scores
            kept = [np.zeros((int(h), pos + 1), np.float32) for h in self.lay[:, fk.L_H]]
            kv = kv.copy()
            kv[:, 7] = [w.ctypes.data for w in kept]
        wall = 0.0

        def call() -> None:
            nonlocal wall
            sync = np.zeros((self.steps + 1) * fk.LINE, np.int64)
            done = np.zeros(self.chunks, np.int64)
            t0 = time.perf_counter()
            if driver is not None:
                driver.begin(int(run[fk.RUN_START]))
            try:
                fk.decode_step(threads, self.descs, self.kquant, self.items, self.lay, self.lf, self.g, self.fpar, kv,
                               table, pos, cs, self.rms_eps, x0, self.shared, priv, iscr, rids, rw, logits.reshape(-1),
                               sync, done, tcycles, run, state, self._flat, self.post, self.cur)
            finally:
                if driver is not None:
                    driver.end()
            wall += time.perf_counter() - t0

        call()
        n_layers = self.lay.shape[0]
        done_to = 0                                      # streamed layers before this one are counted by the store
        while run[fk.RUN_EXIT] < n_layers:               # stopped for a layer's streamed experts
            layer = int(run[fk.RUN_EXIT])
            done_to = self.account_streamed(source, rids, done_to, layer)
            top_k = int(self.lay[layer, fk.L_K])
            ids = rids[layer, :top_k]
            needed = self.union(rids, layer)
            brought = 0
            run[fk.RUN_START], run[fk.RUN_RESUME] = layer, 1
            ahead = None if predict is None else (lambda: predict(layer, state[: self.hidden]))
            for group in source.groups(layer, needed, ahead):   # each stays in memory until the next is asked for
                slots = [j for j in range(top_k) if int(ids[j]) in group]
                for j in slots:
                    self._bring(layer, j, group[int(ids[j])])
                brought += len(group)
                run[fk.RUN_ACTIVE] = len(slots)
                run[fk.RUN_SLOTS : fk.RUN_SLOTS + len(slots)] = slots
                run[fk.RUN_LAST] = int(brought == len(needed))
                call()
            done_to = layer + 1
        if self.streamed_layers:
            self.account_streamed(source, rids, done_to, n_layers)
        self._threads.record(threads, wall)
        total = max(1, int(tcycles[:4].sum()))
        seconds = {name: wall * int(tcycles[j]) / total
                   for j, name in enumerate(("attention", "dense", "experts", "io_wait")) if j < 3 or tcycles[j]}
        return logits, FusedStep(rids, rw, self.moe, seconds, kept)

    def account_streamed(self, source, rids: np.ndarray, lo: int, hi: int, rows: int = 1) -> int:
        """Have the store count the streamed layers lo .. hi - 1, run without stopping (their experts were all in
        memory), each layer's experts of `rows` rows (a batch's union, rids [L, rows * K]) as one step; returns hi."""
        steps = [(i, self.union(rids, i, rows)) for i in self.streamed_layers if lo <= i < hi]
        if steps:
            source.account_steps(steps)
        return hi

    def union(self, rids: np.ndarray, layer: int, rows: int = 1) -> list[int]:
        """The experts `rows` rows chose in a layer (rids [L, rows * K]), ascending, each once."""
        return sorted(set(rids[layer, : rows * int(self.lay[layer, fk.L_K])].tolist()))

    def _release(self, key: tuple[int, int]) -> bool:
        """Unflag a streamed expert that is to leave, unless a thread of a running call is at its layer (then it
        stays flagged and untouched, and False)."""
        layer, e = key
        if layer not in self.streamed_layers or self.flags[layer, e] != 1:
            return True
        idx = layer * self.flags.shape[1] + e
        set_flag(self._flat, idx, 0)                    # then no thread that looks finds it ...
        if in_use(self.cur, len(self.cur) // fk.LINE, layer):
            set_flag(self._flat, idx, 1)                # ... but one at its layer may have found it before
            return False
        return True

    def _bring(self, layer: int, slot: int, expert) -> None:
        """Point slot `slot` of a streamed layer at an expert in memory (for the next call only: the store may
        reuse its memory once the caller asks for the next group)."""
        self._point(self._exp0[layer] + 3 * slot, layer, slot, expert)

    def _bring_expert(self, layer: int, e: int, expert) -> None:
        """Point the rows of expert e of a streamed layer (those its flag publishes) at it in memory, for the batch's
        next call (engine/fused/batch.py); its flag is left as it is, so that no single step reads the rows
        unless the store says the expert stays."""
        self._point(self._res0[layer] + 3 * e, layer, e, expert)

    def _point(self, row: int, layer: int, slot: int, expert) -> None:
        """Write an expert's gate, up and down descriptors at rows row .. row + 2, checked for the step's shapes."""
        i_ff = self._i_ff[layer]
        for m, w in enumerate((expert.gate, expert.up, expert.down)):
            want = (self.hidden, i_ff) if m == 2 else (i_ff, self.hidden)
            if not isinstance(w, (QuantizedTensor, KQuantTensor)) or w.shape != want:
                raise GenerationError(f"expert {expert.names[m] or slot} of layer {layer} is not a quantized "
                                      f"{want[0]}x{want[1]} matrix as the fused step expects")
            self.descs[row + m] = w.descriptor_row


def guessed(top_k: int, n_experts: int, extra: int | None) -> int:
    """How many experts the read-ahead guesses for a layer: top_k and half as many again (or `extra` more), as
    DecodeContext.predict does."""
    return min(n_experts, top_k + (top_k // 2 if extra is None else extra), MAX_GUESS)


def _store_kinds(store) -> set[str | None] | None:
    """The quant meta kinds of the experts an expert store serves ("f32": not quantized), or None for a store that
    does not say."""
    container = getattr(store, "container", None)
    names = getattr(store, "names", None)
    if container is None or names is None:
        return None
    entries = (container.entries[n] for trio in names.values() for n in trio)
    return {(e.quant or {}).get("kind") if e.kind == "quant" else "f32" for e in entries}


def _quantized_store(store) -> bool:
    """Whether every expert an expert store serves is in a format the fused step runs: Colibri's, or GGUF K-quant /
    IQ4 blocks (FP8 and MXFP4 experts run through the blocks)."""
    kinds = _store_kinds(store)
    return kinds is not None and kinds <= {QUANT_META_KIND, KQUANT_META_KIND}


def _kquant_store(store) -> bool:
    """Whether an expert store serves GGUF K-quant / IQ4 experts (the step must compile their kernels)."""
    kinds = _store_kinds(store)
    return kinds is not None and KQUANT_META_KIND in kinds


class _NotFusable(Exception):
    """A layer the fused kernel does not run (the reason, for debugging)."""


def record(step: FusedStep, telemetry: Telemetry) -> None:
    """Count a fused step's phase times and routes into the telemetry."""
    if not telemetry.enabled:
        return
    for name, seconds in step.seconds.items():
        telemetry.add_time(name, seconds)
    for r in step.routing():
        telemetry.route(r.layer, r.experts)
