"""Grouped-query attention with a KV cache: projections, optional q/k norms, RoPE, causal softmax (with
optional per-head sinks in its denominator, gpt-oss; soft-capped scores, Gemma 2), and optionally a sigmoid
gate on each head's output (Qwen3-Next)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.blocks.linear import Probe, linear, linear_many
from engine.blocks.norm import rms_norm
from engine.blocks.rope import Rotary
from engine.kv import LayerKV
from engine.spec import AttentionSpec
from engine.weights import Weights


def attention_shapes(spec: AttentionSpec, prefix: str, hidden: int) -> dict[str, tuple[int, ...]]:
    """The tensors of one attention block, by name, with their shapes."""
    q_out, kv_out = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    q_rows = 2 * q_out if spec.output_gate else q_out     # each head's query, then its output gate
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}.q_proj.weight": (q_rows, hidden),
        f"{prefix}.k_proj.weight": (kv_out, hidden),
        f"{prefix}.v_proj.weight": (kv_out, hidden),
        f"{prefix}.o_proj.weight": (hidden, q_out),
    }
    if spec.qkv_bias:
        shapes |= {f"{prefix}.q_proj.bias": (q_rows,), f"{prefix}.k_proj.bias": (kv_out,), f"{prefix}.v_proj.bias": (kv_out,)}
    if spec.o_bias:
        shapes[f"{prefix}.o_proj.bias"] = (hidden,)
    if spec.qk_norm == "head":
        shapes |= {f"{prefix}.q_norm.weight": (spec.head_dim,), f"{prefix}.k_norm.weight": (spec.head_dim,)}
    elif spec.qk_norm == "full":
        shapes |= {f"{prefix}.q_norm.weight": (q_out,), f"{prefix}.k_norm.weight": (kv_out,)}
    if spec.sinks:
        shapes[f"{prefix}.sinks"] = (spec.n_heads,)
    return shapes


Segments = Sequence[tuple[slice, LayerKV]]   # rows of the batch and the cache of the sequence they belong to


def causal_mask(q_pos: np.ndarray, k_len: int, window: int | None) -> np.ndarray:
    """Additive mask [T, S]: 0 where query i may see key j (j <= pos_i, within the window), -inf elsewhere."""
    k_pos = np.arange(k_len)[None, :]
    allowed = k_pos <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos > q_pos[:, None] - window
    return np.where(allowed, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


def softmax_rows(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in float32, stable with -inf entries."""
    scores = scores - scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    """softmax(q k^T * scale + mask) v for grouped heads, in plain numpy (the reference of the kernel).

    q [T, H, D], k [Hkv, S, D], v [Hkv, S, Dv], mask [T, S] -> [T, H, Dv].
    """
    t, h, d = q.shape
    hkv = k.shape[0]
    g = h // hkv
    qg = q.reshape(t, hkv, g, d).transpose(1, 2, 0, 3)          # [Hkv, G, T, D]
    scores = np.matmul(qg, k.transpose(0, 2, 1)[:, None])        # [Hkv, G, T, S]
    scores *= np.float32(scale)
    scores += mask
    probs = softmax_rows(scores)
    out = np.matmul(probs, v[:, None])                           # [Hkv, G, T, Dv]
    return out.transpose(2, 0, 1, 3).reshape(t, h, v.shape[-1])  # [T, H, Dv]


def attend_capped(q: np.ndarray, positions: np.ndarray, cache: LayerKV, spec: AttentionSpec) -> np.ndarray:
    """Attention with soft-capped scores (Gemma 2): softmax(tanh(q k^T * scale / c) * c) v over each query's
    keys (its window when the layer has one); q [T, H, D] -> [T, H, D].

    Row by row, each over exactly the keys it sees, so a token's bits do not depend on how many came with it
    (a prompt, a decode step); the attention weights go to the cache's retention scores when it keeps them.
    """
    t, h, d = q.shape
    g = h // spec.n_kv_heads
    w = spec.sliding_window
    first = max(0, int(positions.min()) - w + 1) if w else 0
    k, v = cache.read(first, int(positions.max()) + 1)                # [Hkv, S, D] each
    cap, scale = np.float32(spec.softcap), np.float32(spec.scale)
    out = np.empty((t, h, v.shape[2]), np.float32)
    for i, p in enumerate(positions.tolist()):
        lo = max(0, p - w + 1) if w else 0
        kk, vv = k[:, lo - first : p + 1 - first], v[:, lo - first : p + 1 - first]    # [Hkv, S_i, D]
        qg = q[i].reshape(spec.n_kv_heads, g, d)                              # [Hkv, G, D]
        scores = np.matmul(qg, kk.transpose(0, 2, 1)) * scale                # [Hkv, G, S_i]
        scores = np.tanh(scores / cap) * cap
        probs = softmax_rows(scores)
        out[i] = np.matmul(probs, vv).reshape(h, -1)                         # [H, D]
        if cache.seq.tracking:
            weights = np.zeros((h, p + 1), np.float32)
            weights[:, lo:] = probs.reshape(h, -1)
            cache.seq.observe(weights)
    return out


@dataclass(frozen=True)
class Attention:
    """One GQA block's weights and its forward pass."""

    spec: AttentionSpec
    rotary: Rotary
    rms_eps: float
    prefix: str     # tensor name prefix, e.g. "model.layers.3.self_attn"
    wq: np.ndarray  # [H*D, hidden] ([2*H*D, hidden] with an output gate)
    wk: np.ndarray  # [Hkv*D, hidden]
    wv: np.ndarray  # [Hkv*D, hidden]
    wo: np.ndarray  # [hidden, H*D]
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    bo: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    sinks: np.ndarray | None = None  # [H] (gpt-oss)

    @classmethod
    def load(cls, spec: AttentionSpec, w: Weights, prefix: str, rotary: Rotary, rms_eps: float) -> "Attention":
        """Take the block's tensors from `w`."""
        return cls(
            spec, rotary, rms_eps, prefix,
            w[f"{prefix}.q_proj.weight"], w[f"{prefix}.k_proj.weight"],
            w[f"{prefix}.v_proj.weight"], w[f"{prefix}.o_proj.weight"],
            w.get(f"{prefix}.q_proj.bias"), w.get(f"{prefix}.k_proj.bias"),
            w.get(f"{prefix}.v_proj.bias"), w.get(f"{prefix}.o_proj.bias"),
            w.get(f"{prefix}.q_norm.weight"), w.get(f"{prefix}.k_norm.weight"),
            w.get(f"{prefix}.sinks"),
        )

    def __call__(self, x: np.ndarray, positions: np.ndarray, segments: Segments, probe: Probe | None = None) -> np.ndarray:
        """x [T, hidden] at `positions` -> [T, hidden]. The rows may belong to several sequences
        (`segments`: rows and cache of each); each writes its keys/values to its own cache and
        attends over it, while the projections run once for all rows."""
        s, t = self.spec, x.shape[0]
        if probe is not None:
            for proj in ("q_proj", "k_proj", "v_proj"):
                probe(f"{self.prefix}.{proj}.weight", x)
        q, k, v = linear_many(x, (self.wq, self.wk, self.wv))     # [T, H*D], [T, Hkv*D] x 2
        if self.bq is not None:
            q, k, v = q + self.bq, k + self.bk, v + self.bv
        gate = None
        if s.output_gate:                                        # per head: D query features, then D gate features
            qg = q.reshape(t, s.n_heads, 2, s.head_dim)
            q, gate = qg[:, :, 0].reshape(t, -1), qg[:, :, 1].reshape(t, -1)   # [T, H*D] each
        if s.qk_norm == "full":
            q, k = rms_norm(q, self.q_norm, self.rms_eps), rms_norm(k, self.k_norm, self.rms_eps)
        if s.clip_qkv is not None:
            c = np.float32(s.clip_qkv)
            q, k, v = np.clip(q, -c, c), np.clip(k, -c, c), np.clip(v, -c, c)
        q = q.reshape(t, s.n_heads, s.head_dim)                  # [T, H, D]
        k = k.reshape(t, s.n_kv_heads, s.head_dim)               # [T, Hkv, D]
        v = v.reshape(t, s.n_kv_heads, s.head_dim)
        if s.qk_norm == "head":
            q, k = rms_norm(q, self.q_norm, self.rms_eps), rms_norm(k, self.k_norm, self.rms_eps)
        cos, sin = self.rotary.tables(positions)
        q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        out = np.empty((t, s.n_heads, s.head_dim), np.float32)
        for rows, cache in segments:
            pos = positions[rows]
            cache.write(int(pos[0]), k[rows], v[rows])
            if s.softcap is None:
                out[rows] = cache.attend(q[rows], pos, s.scale, s.sliding_window, self.sinks)
            else:
                out[rows] = attend_capped(q[rows], pos, cache, s)
        out = out.reshape(t, -1)                                 # [T, H*D]
        if gate is not None:
            with np.errstate(over="ignore"):                     # exp overflows to inf: the gate is then 0
                out = out * (np.float32(1.0) / (np.float32(1.0) + np.exp(-gate)))
        if probe is not None:
            probe(f"{self.prefix}.o_proj.weight", out)
        out = linear(out, self.wo)
        return out + self.bo if self.bo is not None else out
