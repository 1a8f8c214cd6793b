"""Kimi delta attention (Kimi Linear): gated DeltaNet's recurrence with a decay per key channel.

q, k and v come from their own projections and causal depthwise convolutions (SiLU); q and k are L2-normed,
q scaled by Dk^-0.5. A low-rank forget gate gives each head's key channels their decay,
exp(-exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)), beta is sigmoid(b_proj(x)), and a low-rank output gate
scales the RMS-normed output by sigmoid(g_b(g_a(x))). The sequence's state (the convolution's last K-1
inputs and S [H, Dk, Dv]) lives in the cache's `LayerState` as DeltaNet's does, so prefill and decode run
the same recurrence token by token (engine/kernels/kda.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.blocks.attention import Segments
from engine.blocks.deltanet import _l2norm, _sigmoid, _softplus
from engine.blocks.linear import Probe, linear, linear_many
from engine.blocks.norm import activation, rms_norm
from engine.kernels.kda import kda_rule
from engine.kv import LayerState
from engine.spec import KimiDeltaSpec
from engine.weights import Weights

INPUTS = ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj")   # the projections of the layer input


def kda_shapes(spec: KimiDeltaSpec, prefix: str, hidden: int) -> dict[str, tuple[int, ...]]:
    """The tensors of one Kimi delta attention block, by name, with their shapes."""
    h, d, taps = spec.n_v_heads, spec.v_head_dim, spec.conv_kernel
    width = h * d
    shapes = {f"{prefix}.{name}.weight": (width, hidden) for name in ("q_proj", "k_proj", "v_proj")}
    shapes |= {f"{prefix}.{name}_conv1d.weight": (width, 1, taps) for name in "qkv"}
    return shapes | {
        f"{prefix}.f_a_proj.weight": (d, hidden), f"{prefix}.f_b_proj.weight": (width, d),
        f"{prefix}.g_a_proj.weight": (d, hidden), f"{prefix}.g_b_proj.weight": (width, d),
        f"{prefix}.b_proj.weight": (h, hidden), f"{prefix}.dt_bias": (width,), f"{prefix}.A_log": (1, 1, h, 1),
        f"{prefix}.o_norm.weight": (d,), f"{prefix}.o_proj.weight": (hidden, width),
    }


@dataclass(frozen=True)
class KimiDeltaAttention:
    """One Kimi delta attention block's weights and its forward pass."""

    spec: KimiDeltaSpec
    prefix: str                   # tensor name prefix, e.g. "model.layers.0.self_attn"
    w_in: tuple                   # q, k, v [H*D, hidden]; f_a, g_a [D, hidden]; b [H, hidden] (INPUTS' order)
    w_f_b: np.ndarray             # [H*D, D] the forget gate's up projection
    w_g_b: np.ndarray             # [H*D, D] the output gate's up projection
    conv: np.ndarray              # [K, 3*H*D] taps per channel of q, k, v side by side, oldest input first
    neg_a: np.ndarray             # [H, 1] -exp(A_log): each head's decay rate
    dt_bias: np.ndarray           # [H*D]
    norm: np.ndarray              # [D] the gated output norm's weight
    w_out: np.ndarray             # [hidden, H*D]

    @classmethod
    def load(cls, spec: KimiDeltaSpec, w: Weights, prefix: str) -> "KimiDeltaAttention":
        """Take the block's tensors from `w`."""
        taps = [w.dense(f"{prefix}.{n}_conv1d.weight").reshape(-1, spec.conv_kernel) for n in "qkv"]
        a_log = w.dense(f"{prefix}.A_log").astype(np.float32).reshape(spec.n_v_heads, 1)
        return cls(
            spec, prefix, tuple(w[f"{prefix}.{name}.weight"] for name in INPUTS),
            w[f"{prefix}.f_b_proj.weight"], w[f"{prefix}.g_b_proj.weight"],
            np.ascontiguousarray(np.concatenate(taps).T, np.float32), (-np.exp(a_log)).astype(np.float32),
            w.dense(f"{prefix}.dt_bias").astype(np.float32), w.dense(f"{prefix}.o_norm.weight").astype(np.float32),
            w[f"{prefix}.o_proj.weight"],
        )

    def __call__(self, x: np.ndarray, positions: np.ndarray, segments: Segments, probe: Probe | None = None) -> np.ndarray:
        """x [T, hidden] -> [T, hidden]. The rows may belong to several sequences (`segments`: rows and the
        sequence's `LayerState` of this layer); each runs on from its own state, the projections run once."""
        s, t = self.spec, x.shape[0]
        h, d = s.n_v_heads, s.v_head_dim
        if probe is not None:
            for name in INPUTS:
                probe(f"{self.prefix}.{name}.weight", x)
        q, k, v, f_a, g_a, b = linear_many(x, self.w_in)
        if probe is not None:
            probe(f"{self.prefix}.f_b_proj.weight", f_a)
            probe(f"{self.prefix}.g_b_proj.weight", g_a)
        mixed = np.concatenate([q, k, v], axis=1)                           # [T, 3*H*D]
        beta = _sigmoid(b)                                                   # [T, H]
        forget = _softplus(linear(f_a, self.w_f_b) + self.dt_bias).reshape(t, h, d)
        decay = np.exp(self.neg_a * forget).astype(np.float32)               # [T, H, D] per key channel
        core = np.empty((t, h, d), np.float32)                               # [T, H, D]
        for rows, cache in segments:
            assert isinstance(cache, LayerState)
            core[rows] = self._run(mixed[rows], beta[rows], decay[rows], cache)
        gate = linear(g_a, self.w_g_b).reshape(t, h, d)                      # [T, H, D]
        out = (rms_norm(core, self.norm, s.rms_eps) * _sigmoid(gate)).reshape(t, h * d)
        if probe is not None:
            probe(f"{self.prefix}.o_proj.weight", out)
        return linear(out, self.w_out)

    def _run(self, mixed: np.ndarray, beta: np.ndarray, decay: np.ndarray, cache: LayerState) -> np.ndarray:
        """One sequence's tokens: convolution then the rule from its held state; its outputs [T, H, D]."""
        s, t = self.spec, mixed.shape[0]
        h, d, taps = s.n_v_heads, s.v_head_dim, s.conv_kernel
        conv_state, rec = cache.state()                                      # [K-1, C], [H, D, D]
        inputs = np.concatenate([conv_state, mixed.astype(np.float32)])      # [K-1+T, C]
        conv = np.zeros_like(mixed, dtype=np.float32)                        # [T, C]
        for j in range(taps):
            conv += inputs[j : j + t] * self.conv[j]
        conv = activation(s.act)(conv)
        width = h * d
        q = np.ascontiguousarray(_l2norm(conv[:, :width].reshape(t, h, d), d**-0.5))   # [T, H, D], scaled
        k = np.ascontiguousarray(_l2norm(conv[:, width : 2 * width].reshape(t, h, d)))
        v = np.ascontiguousarray(conv[:, 2 * width :].reshape(t, h, d))
        decay, beta = np.ascontiguousarray(decay), np.ascontiguousarray(beta)
        out = np.empty((t, h, d), np.float32)
        rec = rec.copy()                                  # the step's own: held and kept states stay as they are
        after = cache.wanted(t)                           # states kept after these many tokens (the last included)
        states, done = [], 0
        for c in after:                                   # the rule runs token by token: segments give the same bits
            a = slice(done, c)
            kda_rule(rec, q[a], k[a], v[a], decay[a], beta[a], out[a])
            states.append((inputs[c : c + taps - 1].copy(), rec if c == t else rec.copy()))
            done = c
        cache.write(states, after)
        return out
