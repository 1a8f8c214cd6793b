"""The rows16 layout (4- and 8-bit symmetric codes, 16 rows interleaved) and its integer kernels: bitwise against a
plain numpy reference of their arithmetic, and invariant to tokens, row ranges and threads."""

from __future__ import annotations

import numpy as np
import pytest

from engine.kernels import matmul as kernels
from engine.kernels.layout import ROWS16_FLAG, f16_bits, from_rows16, quantize_activations, to_rows16
from engine.kernels.rows16 import quantize_tokens
from engine.quant import QuantizedTensor, quantize
from support.kernels import acts, rows16_dot, weights


@pytest.mark.parametrize("bits", [4, 8])
def test_the_layout_is_a_reordering_that_keeps_every_weight(bits):
    q = quantize(weights(48, 256, 0), bits, 64, layout="planes")
    a16, s16 = to_rows16(q.a, q.scales)
    assert a16.shape == q.a.shape and s16.shape == q.scales.shape and not np.array_equal(a16, q.a)
    back = from_rows16(a16, s16)
    assert np.array_equal(back[0], q.a) and np.array_equal(back[1], q.scales)
    r = q.with_layout("rows16")
    assert r.layout == "rows16" and r.nbytes == q.nbytes and r.with_layout("planes").layout == "planes"
    assert np.array_equal(r.dequantize(), q.dequantize())
    assert np.array_equal(r.dequantize_rows(5, 37), q.dequantize()[5:37])          # rows inside and across blocks
    ids = np.array([0, 15, 16, 47, 3])
    assert np.array_equal(r.rows(ids), q.dequantize()[ids])                        # the kernels' dequantization
    meta, buffers = r.to_buffers()
    assert meta["layout"] == "rows16-v1"
    again = QuantizedTensor.from_buffers(meta, buffers)
    assert again.layout == "rows16" and np.array_equal(again.a, r.a)


def test_quantize_takes_rows16_where_it_applies_and_names_where_it_cannot():
    assert quantize(weights(32, 64, 1), 4, 32).layout == "rows16"
    assert quantize(weights(37, 64, 1), 4, 32).layout == "planes"                       # not whole 16-row blocks
    assert quantize(weights(32, 64, 1), 8, 32).layout == "rows16"
    assert quantize(weights(32, 64, 1), 6, 32).layout == "planes"
    assert quantize(weights(32, 64, 1), 4, 32, asymmetric=True).layout == "planes"
    with pytest.raises(ValueError, match="rows16 layout holds 4- and 8-bit symmetric"):
        quantize(weights(37, 64, 1), 4, 32, layout="rows16")
    with pytest.raises(ValueError, match="unknown quantized layout"):
        quantize(weights(32, 64, 1), 4, 32, layout="tiles")


def test_activation_quantization_in_the_kernel_equals_numpy():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 128)).astype(np.float32) * np.float32(3.0)
    x[1, :32] = 0.0                                                     # an all-zero block
    x[2, 32:64] = np.arange(32, dtype=np.float32) - 15.5                # halves: x * 127 / amax ties
    x[3, 64:96] = np.float32(1e30) * rng.standard_normal(32).astype(np.float32)
    x[4, 96:128] = -np.float32(2.0)                                    # all equal: +-127 exactly
    q, d, s = (np.empty(5 * 128, np.int8), np.empty(5 * 4, np.float32), np.empty(5 * 4, np.int32))
    quantize_tokens(x.reshape(-1), np.arange(5), 0, 5, 128, q, d, s)
    xq, dx, sums = quantize_activations(x)
    assert np.array_equal(q.reshape(5, 128), xq) and np.array_equal(d.reshape(5, 4), dx)
    assert np.array_equal(s.reshape(5, 4), sums)
    assert (xq[1, :32] == 0).all() and dx[1, 0] == 0 and (xq[4, 96:] == -127).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows, cols, group", [(16, 64, 32), (48, 256, 64), (64, 256, 128), (32, 1024, 32)])
def test_matmul_matches_the_reference_bitwise(bits, rows, cols, group):
    q = quantize(weights(rows, cols, rows), bits, group)
    assert q.layout == "rows16"
    for t in (1, 2, 3, 4, 5, 8, 9, 17):
        x = acts(t, cols, t)
        assert np.array_equal(q.matmul(x), rows16_dot(q, x)), t


@pytest.mark.parametrize("bits", [4, 8])
def test_any_rows_tokens_and_threads_give_the_same_bits(bits, threads):
    q = quantize(weights(80, 256, 3), bits, 32)
    x = acts(11, 256, 4)
    whole = q.matmul(x)
    assert np.array_equal(np.concatenate([q.matmul(x[i:i + 1]) for i in range(11)]), whole)
    threads(1)
    assert np.array_equal(q.matmul(x), whole)
    # rows cut anywhere (the fused decode step's chunks): blocks computed whole, stored in part
    code, asym, group, _, cols, a, b, sc, mn = kernels.planes(q.descriptor_row)
    assert code == bits | ROWS16_FLAG
    out = np.full((2, 80), np.nan, np.float32)
    tokens = np.array([3, 7])
    for r0, r1 in ((0, 5), (5, 21), (21, 64), (64, 80)):
        kernels.otf_rows(code, asym, group, a, b, sc, mn, cols, r0, r1 - r0, x.reshape(-1), tokens, np.arange(2), 0, 2,
                         out.reshape(-1), 80, r0)
    assert np.array_equal(out, whole[tokens])


@pytest.mark.parametrize("bits", [4, 8])
def test_the_float_path_and_rows16_agree_closely(bits):
    # the integer path rounds activations to 8 bits per 32-block: close to the float kernels, not equal
    q = quantize(weights(64, 512, 5), bits, 32)
    x = acts(3, 512, 6)
    exact = x @ q.dequantize().T
    err = np.abs(q.matmul(x) - exact).max() / np.abs(exact).max()
    assert 0 < err < 0.02


@pytest.mark.parametrize("bits", [4, 8])
def test_random_codes_and_scales_rows16_equal_the_reference(bits):
    # codes and scales drawn at random (every code value, scales of both signs and sizes)
    rng = np.random.default_rng(7)
    a = rng.integers(0, 256, (32, 8 * bits * 4), dtype=np.uint8)
    scales = f16_bits(rng.uniform(-0.02, 0.02, (32, 4)))
    planes = QuantizedTensor((32, 256), bits, 64, False, a, np.zeros((32, 0), np.uint8), scales, np.zeros((32, 0), np.uint16))
    q = planes.with_layout("rows16")
    x = acts(6, 256, 8)
    assert np.array_equal(q.matmul(x), rows16_dot(q, x))
