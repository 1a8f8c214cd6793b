"""GGUF K-quant and IQ4 matrices through their 13-int descriptors (the fused step's table): rows against gguf's dequantization
and numpy products, bitwise equal to the tensor's own matmul; the fused expert call runs them beside Colibri's formats."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.blocks.ffn import ExpertWeights, gated_mlp
from engine.blocks.norm import silu
from engine.kernels.experts import moe_experts
from engine.kernels.kquant import KQUANT_FLAG, kq_desc_rows
from engine.quant import KQuantTensor, quantize
from support.kernels import fma32
from support.kquant_blocks import IQ_TYPES, TYPES, random_k_blocks


@pytest.mark.parametrize("qtype", TYPES + IQ_TYPES)
def test_descriptor_rows_match_numpy_and_the_tensor(qtype):
    rng = np.random.default_rng(int(qtype) + 7)
    rows, cols = 23, 576 if qtype == gguf.GGMLQuantizationType.IQ4_NL else 512
    raw = random_k_blocks(qtype, rows, cols, rng)
    t = KQuantTensor((rows, cols), qtype, raw)
    desc = t.descriptor_row
    assert desc[0] == KQUANT_FLAG and tuple(desc[3:5]) == (rows, cols) and len(t.descriptor) == 13
    x = rng.standard_normal((3, cols)).astype(np.float32)
    out = np.full(2 * 40, np.nan, np.float32)                     # token 2 into out row 1, columns 5 ..
    for r0, r1 in ((0, 8), (8, 11), (11, 23)):                     # whole 4-row tiles and a remainder
        kq_desc_rows(desc, r0, r1 - r0, x.reshape(-1), np.array([2]), np.array([1]), 0, 1, out, 40, 5 + r0)
    got = out[40 + 5:40 + 5 + rows]
    w = np.asarray(gguf.quants.dequantize(raw, qtype), np.float64).reshape(rows, cols)
    ref = w @ x[2].astype(np.float64)
    bound = cols * np.finfo(np.float32).eps * (np.abs(w) @ np.abs(x[2]).astype(np.float64))
    assert np.all(np.abs(got - ref) <= bound + 1e-30)
    assert np.array_equal(got.view(np.uint32), t.matmul(x[2:3])[0].view(np.uint32))
    assert np.isnan(out[:40]).all() and np.isnan(out[40:45]).all()   # nothing written outside its rows


HIDDEN, INTER = 256, 512


def _k_experts(rng) -> list[ExpertWeights]:
    """Four experts as a GGUF holds them: Q4_K gate and up with a Q6_K down (a Q4_K_M), Q5_K and Q2_K; IQ4_XS and
    IQ4_NL with a Colibri 8-bit down (llama.cpp's Q8_0 fallback, repacked), in one table."""
    def k(qtype, rows, cols):
        return KQuantTensor((rows, cols), qtype, random_k_blocks(qtype, rows, cols, rng))

    def q8(rows, cols):
        return quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), 8, 32)

    Q = gguf.GGMLQuantizationType
    return [ExpertWeights(k(Q.Q4_K, INTER, HIDDEN), k(Q.Q4_K, INTER, HIDDEN), k(Q.Q6_K, HIDDEN, INTER)),
            ExpertWeights(k(Q.Q5_K, INTER, HIDDEN), k(Q.Q2_K, INTER, HIDDEN), k(Q.Q3_K, HIDDEN, INTER)),
            ExpertWeights(k(Q.IQ4_XS, INTER, HIDDEN), k(Q.IQ4_NL, INTER, HIDDEN), q8(HIDDEN, INTER)),
            ExpertWeights(k(Q.Q4_K, INTER, HIDDEN), k(Q.Q4_K, INTER, HIDDEN), k(Q.Q6_K, HIDDEN, INTER))]


@pytest.mark.parametrize("t", [1, 5])              # decode (on the fly) and prefill (dequantized tiles)
def test_fused_experts_run_k_quant_experts(t, threads):
    rng = np.random.default_rng(t)
    experts = _k_experts(rng)
    x = (rng.standard_normal((t, HIDDEN)) * 0.1).astype(np.float32)        # gate outputs in exp's range
    ids = np.stack([rng.choice(len(experts), 2, replace=False) for _ in range(t)]).astype(np.int64)
    weights = rng.random((t, 2)).astype(np.float32)
    got = moe_experts(x, ids, weights, experts)
    # the numbers each expert's own K-quant (or Colibri) kernels give, slots summed in order with one fma each
    want = np.zeros((t, HIDDEN), np.float32)
    for i in range(t):
        for k in range(2):
            want[i] = fma32(weights[i, k], gated_mlp(x[i:i + 1], experts[ids[i, k]], silu)[0], want[i])
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    threads(1)
    assert np.array_equal(moe_experts(x, ids, weights, experts).view(np.uint32), want.view(np.uint32))
    # and against plain numpy on gguf's dequantization (float64 products): float32 rounding of long sums only
    ref = np.zeros((t, HIDDEN))
    for i in range(t):
        for k in range(2):
            e = experts[ids[i, k]]
            w = [m.dequantize().astype(np.float64) for m in (e.gate, e.up, e.down)]
            g, u = w[0] @ x[i], w[1] @ x[i]
            ref[i] += weights[i, k] * (w[2] @ (g / (1 + np.exp(-g)) * u))
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
