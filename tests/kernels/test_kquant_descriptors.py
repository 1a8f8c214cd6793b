"""GGUF K-quant and IQ4 matrices through their 13-int descriptors (the fused step's table): rows against gguf's dequantization
and numpy products, bitwise equal to the tensor's own matmul; kernels of Colibri's layout refuse them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.kernels.experts import moe_experts
from engine.kernels.kquant import KQUANT_FLAG, kq_desc_rows
from engine.quant import KQuantTensor
from support.kquant_blocks import IQ_TYPES, TYPES, random_k_blocks

pytestmark = pytest.mark.xdist_group("kquant")   # one worker compiles the K-quant kernels (tests/conftest.py)


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


def test_fused_expert_kernels_refuse_k_quant_experts_clearly():
    rng = np.random.default_rng(0)

    class Expert:
        gate = KQuantTensor((8, 256), gguf.GGMLQuantizationType.Q4_K, random_k_blocks(gguf.GGMLQuantizationType.Q4_K, 8, 256, rng))
        up = gate
        down = KQuantTensor((256, 256), gguf.GGMLQuantizationType.Q4_K, random_k_blocks(gguf.GGMLQuantizationType.Q4_K, 256, 256, rng))

    x = rng.standard_normal((1, 256)).astype(np.float32)
    with pytest.raises(ValueError, match="expert 0: its gate matrix is a GGUF K-quant .* do not run"):
        moe_experts(x, np.zeros((1, 1), np.int64), np.ones((1, 1), np.float32), [Expert()])
