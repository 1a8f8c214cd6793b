"""Gated DeltaNet linear attention (Qwen3-Next): a causal depthwise convolution, then the gated delta rule.

Per value head the layer keeps a matrix S [Dk, Dv]. Each token decays it by exp(g), writes the part of
its value that S does not already predict from its key (the delta rule, at rate beta), and reads its
output with its query. The sequence's state (the convolution's last K-1 inputs and S) lives in the
cache (`engine.kv.LayerState`), so prefill and decode run the same recurrence token by token, a whole
step in one compiled call (engine/kernels/deltanet.py) that also copies out the states the cache wants
kept (after each token of a short step; at a block boundary, for the prefix cache's checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.blocks.attention import Segments
from engine.blocks.linear import Probe, linear
from engine.blocks.norm import activation, rms_norm
from engine.kernels.deltanet import delta_rule
from engine.kv import LayerState
from engine.spec import GatedDeltaNetSpec
from engine.weights import Weights


def deltanet_shapes(spec: GatedDeltaNetSpec, prefix: str, hidden: int) -> dict[str, tuple[int, ...]]:
    """The tensors of one gated DeltaNet block, by name, with their shapes (its input projections fused per
    key head, or apart with `split_proj`)."""
    key, value = spec.n_k_heads * spec.k_head_dim, spec.n_v_heads * spec.v_head_dim
    if spec.split_proj:
        inputs = {f"{prefix}.in_proj_qkv.weight": (2 * key + value, hidden), f"{prefix}.in_proj_z.weight": (value, hidden),
                  f"{prefix}.in_proj_b.weight": (spec.n_v_heads, hidden),
                  f"{prefix}.in_proj_a.weight": (spec.n_v_heads, hidden)}
    else:
        inputs = {f"{prefix}.in_proj_qkvz.weight": (2 * key + 2 * value, hidden),
                  f"{prefix}.in_proj_ba.weight": (2 * spec.n_v_heads, hidden)}
    return {
        **inputs,
        f"{prefix}.conv1d.weight": (spec.conv_dim, 1, spec.conv_kernel),
        f"{prefix}.dt_bias": (spec.n_v_heads,),
        f"{prefix}.A_log": (spec.n_v_heads,),
        f"{prefix}.norm.weight": (spec.v_head_dim,),
        f"{prefix}.out_proj.weight": (hidden, value),
    }


def _orders(s: GatedDeltaNetSpec) -> tuple[np.ndarray, np.ndarray]:
    """Column orders that turn in_proj_qkvz's and in_proj_ba's outputs, grouped per key head ([q k v z] and
    [b a] of each group), into [q | k | v | z] and [b | a] with heads in order."""
    r = s.n_v_heads // s.n_k_heads
    group = 2 * s.k_head_dim + 2 * r * s.v_head_dim
    starts = np.arange(s.n_k_heads)[:, None] * group                       # [Hk, 1]
    dk, dvr = s.k_head_dim, r * s.v_head_dim
    parts = [(0, dk), (dk, dk), (2 * dk, dvr), (2 * dk + dvr, dvr)]          # q, k, v, z inside a group
    qkvz = np.concatenate([(starts + off + np.arange(n)[None]).reshape(-1) for off, n in parts])
    ba_starts = np.arange(s.n_k_heads)[:, None] * 2 * r
    ba = np.concatenate([(ba_starts + off + np.arange(r)[None]).reshape(-1) for off in (0, r)])
    return qkvz, ba


def _l2norm(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """x / sqrt(sum(x^2) + 1e-6) * scale over the last axis (the reference's epsilon).

    As the RMSNorm kernel computes it, x / sqrt(sum/D + 1e-6/D) * (scale / sqrt(D)): its sums run in a fixed
    order per row, so a token's bits do not depend on how many rows the step has (numpy's may)."""
    d = x.shape[-1]
    return rms_norm(x, np.full(d, scale / np.sqrt(d), np.float32), 1e-6 / d)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)), as torch computes it (linear above 20)."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)


@dataclass(frozen=True)
class GatedDeltaNet:
    """One gated DeltaNet block's weights and its forward pass."""

    spec: GatedDeltaNetSpec
    prefix: str                   # tensor name prefix, e.g. "model.layers.0.linear_attn"
    w_qkvz: np.ndarray            # [2*Hk*Dk + 2*Hv*Dv, hidden], grouped per key head
    w_ba: np.ndarray              # [2*Hv, hidden], grouped per key head
    conv: np.ndarray              # [K, C] taps per channel, oldest input first
    neg_a: np.ndarray             # [Hv] -exp(A_log): the decay rate
    dt_bias: np.ndarray           # [Hv]
    norm: np.ndarray              # [Dv] the gated output norm's weight
    w_out: np.ndarray             # [hidden, Hv*Dv]
    order_qkvz: np.ndarray        # column order of in_proj_qkvz's output into [q | k | v | z]
    order_ba: np.ndarray          # column order of in_proj_ba's output into [b | a]
    w_z: np.ndarray | None = None  # [Hv*Dv, hidden] with split_proj (w_qkvz then gives [q | k | v], w_ba b)
    w_a: np.ndarray | None = None  # [Hv, hidden] with split_proj

    @classmethod
    def load(cls, spec: GatedDeltaNetSpec, w: Weights, prefix: str) -> "GatedDeltaNet":
        """Take the block's tensors from `w`."""
        conv = w.dense(f"{prefix}.conv1d.weight").reshape(spec.conv_dim, spec.conv_kernel)
        a_log = w.dense(f"{prefix}.A_log").astype(np.float32)
        if spec.split_proj:           # heads already in order: the identity orders
            order_qkvz, order_ba = np.arange(spec.conv_dim), np.arange(spec.n_v_heads)
            inputs = (w[f"{prefix}.in_proj_qkv.weight"], w[f"{prefix}.in_proj_b.weight"])
            split = dict(w_z=w[f"{prefix}.in_proj_z.weight"], w_a=w[f"{prefix}.in_proj_a.weight"])
        else:
            order_qkvz, order_ba = _orders(spec)
            inputs, split = (w[f"{prefix}.in_proj_qkvz.weight"], w[f"{prefix}.in_proj_ba.weight"]), {}
        return cls(
            spec, prefix, *inputs,
            np.ascontiguousarray(conv.T, np.float32), (-np.exp(a_log)).astype(np.float32),
            w.dense(f"{prefix}.dt_bias").astype(np.float32), w.dense(f"{prefix}.norm.weight").astype(np.float32),
            w[f"{prefix}.out_proj.weight"], order_qkvz, order_ba, **split,
        )

    def _project(self, x: np.ndarray, probe: Probe | None) -> tuple[np.ndarray, np.ndarray]:
        """x [T, hidden] -> qkvz [T, 2*key + 2*value] as [q | k | v | z], ba [T, 2*Hv] as [b | a]."""
        names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a") if self.w_z is not None else \
            ("in_proj_qkvz", "in_proj_ba")
        if probe is not None:
            for name in names:
                probe(f"{self.prefix}.{name}.weight", x)
        qkvz = linear(x, self.w_qkvz)[:, self.order_qkvz]
        ba = linear(x, self.w_ba)[:, self.order_ba]
        if self.w_z is not None:
            qkvz = np.concatenate([qkvz, linear(x, self.w_z)], axis=1)
            ba = np.concatenate([ba, linear(x, self.w_a)], axis=1)
        return qkvz, ba

    def __call__(self, x: np.ndarray, positions: np.ndarray, segments: Segments, probe: Probe | None = None) -> np.ndarray:
        """x [T, hidden] -> [T, hidden]. The rows may belong to several sequences (`segments`: rows and the
        sequence's `LayerState` of this layer); each runs on from its own state, the projections run once."""
        s, t = self.spec, x.shape[0]
        key, value = s.n_k_heads * s.k_head_dim, s.n_v_heads * s.v_head_dim
        qkvz, ba = self._project(x, probe)                                 # [T, 2*key + 2*value], [T, 2*Hv]
        mixed, z = qkvz[:, : 2 * key + value], qkvz[:, 2 * key + value :]   # [T, C], [T, value]
        beta = _sigmoid(ba[:, : s.n_v_heads])                              # [T, Hv]
        decay = np.exp(self.neg_a * _softplus(ba[:, s.n_v_heads :] + self.dt_bias)).astype(np.float32)  # [T, Hv]
        core = np.empty((t, s.n_v_heads, s.v_head_dim), np.float32)        # [T, Hv, Dv]
        for rows, cache in segments:
            assert isinstance(cache, LayerState)
            core[rows] = self._run(mixed[rows], beta[rows], decay[rows], cache)
        # the gated RMSNorm: each head's output normalised, scaled, then gated by silu(z)
        zh = z.reshape(t, s.n_v_heads, s.v_head_dim)
        out = rms_norm(core, self.norm, s.rms_eps) * (zh * _sigmoid(zh))
        out = out.reshape(t, value)                                        # [T, Hv*Dv]
        if probe is not None:
            probe(f"{self.prefix}.out_proj.weight", out)
        return linear(out, self.w_out)

    def _run(self, mixed: np.ndarray, beta: np.ndarray, decay: np.ndarray, cache: LayerState) -> np.ndarray:
        """One sequence's tokens: convolution then the delta rule from its held state; its outputs [T, Hv, Dv]."""
        s, t = self.spec, mixed.shape[0]
        key = s.n_k_heads * s.k_head_dim
        conv_state, rec = cache.state()                                    # [K-1, C], [Hv, Dk, Dv]
        k_taps = s.conv_kernel
        inputs = np.concatenate([conv_state, mixed.astype(np.float32)])    # [K-1+T, C]
        conv = np.zeros_like(mixed, dtype=np.float32)                      # [T, C]
        for j in range(k_taps):
            conv += inputs[j : j + t] * self.conv[j]
        conv = activation(s.act)(conv)
        r = s.n_v_heads // s.n_k_heads
        q = conv[:, :key].reshape(t, s.n_k_heads, s.k_head_dim)
        k = conv[:, key : 2 * key].reshape(t, s.n_k_heads, s.k_head_dim)
        v = conv[:, 2 * key :].reshape(t, s.n_v_heads, s.v_head_dim)       # [T, Hv, Dv]
        q = np.repeat(_l2norm(q, s.k_head_dim**-0.5), r, axis=1)           # [T, Hv, Dk], scaled by Dk^-0.5
        k = np.repeat(_l2norm(k), r, axis=1)                               # [T, Hv, Dk]
        q, k = np.ascontiguousarray(q), np.ascontiguousarray(k)
        v, decay, beta = np.ascontiguousarray(v), np.ascontiguousarray(decay), np.ascontiguousarray(beta)
        out = np.empty((t, s.n_v_heads, s.v_head_dim), np.float32)
        rec = rec.copy()                                  # the step's own: held and kept states stay as they are
        after = cache.wanted(t)                           # states kept after these many tokens (the last included)
        keep = np.asarray(after[:-1], np.int64)
        kept = np.empty((len(keep), *rec.shape), np.float32)   # [M, Hv, Dk, Dv]
        delta_rule(rec, q, k, v, decay, beta, out, keep, kept)
        states = [(inputs[c : c + k_taps - 1].copy(), kept[m]) for m, c in enumerate(keep)]
        states.append((inputs[t : t + k_taps - 1].copy(), rec))
        cache.write(states, after)
        return out
