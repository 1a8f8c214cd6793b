"""FP8 (block-scaled e4m3) and MXFP4 (e2m1 with e8m0 scales) kernels against plain numpy, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from engine.kernels import fp8 as kernels
from engine.kernels.fp32 import matmul_f32
from engine.quant.published import FP8Tensor, MXFP4Tensor


def _fp8(rows: int, cols: int, block=(128, 128), seed: int = 0) -> FP8Tensor:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38            # no NaN codes: 1.0 instead
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scales = rng.uniform(1e-4, 1e-2, grid).astype(np.float32)
    return FP8Tensor(codes, scales, block)


def _mxfp4(rows: int, cols: int, seed: int = 0) -> MXFP4Tensor:
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scales = rng.integers(110, 135, (rows, cols // 32), dtype=np.uint8)
    return MXFP4Tensor(blocks, scales)


def test_e4m3_table_is_torch_float8_e4m3fn():
    torch = pytest.importorskip("torch")
    ref = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(kernels.E4M3, ref)                  # NaN where torch has NaN
    assert np.isnan(kernels.E4M3).sum() == 2 and np.nanmax(kernels.E4M3) == 448.0


def test_e2m1_and_e8m0_tables_follow_the_definitions():
    from transformers.integrations.mxfp4 import FP4_VALUES

    np.testing.assert_array_equal(kernels.E2M1, np.array(FP4_VALUES, np.float32))
    assert kernels.E8M0[127] == 1.0 and kernels.E8M0[128] == 2.0 and kernels.E8M0[0] == np.float32(2.0**-127)
    assert np.isnan(kernels.E8M0[255])


@pytest.mark.parametrize("shape,block", [((200, 300), (128, 128)), ((64, 96), (32, 32)), ((7, 40), (3, 16))])
def test_fp8_rows_and_matmul_bit_for_bit(shape, block):
    w = _fp8(*shape, block=block)
    ref = w.dequantize()                                                  # numpy, from the definition
    np.testing.assert_array_equal(w.rows(np.arange(shape[0])), ref)
    np.testing.assert_array_equal(w.rows([5, 0, 5]), ref[[5, 0, 5]])
    x = np.random.default_rng(1).standard_normal((9, shape[1])).astype(np.float32)
    out = w.matmul(x)
    np.testing.assert_array_equal(out, matmul_f32(x, ref))                # the float32 kernel's FMA order
    np.testing.assert_allclose(out, x.astype(np.float64) @ ref.T.astype(np.float64), rtol=1e-4, atol=1e-5)
    for t in (0, 3, 8):                                                   # independent of the batch
        np.testing.assert_array_equal(w.matmul(x[t:t + 1]), out[t:t + 1])


def test_fp8_scales_apply_per_block():
    codes = np.full((4, 6), 0x38, np.uint8)                              # every weight 1.0
    w = FP8Tensor(codes, np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), (2, 4))
    np.testing.assert_array_equal(w.dequantize(), [[1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 2, 2],
                                                   [3, 3, 3, 3, 4, 4], [3, 3, 3, 3, 4, 4]])


def test_fp8_refuses_a_scale_grid_that_does_not_fit():
    with pytest.raises(ValueError, match="128 x 128 blocks"):
        FP8Tensor(np.zeros((256, 256), np.uint8), np.ones((1, 2), np.float32), (128, 128))


@pytest.mark.parametrize("shape", [(40, 64), (9, 2880 // 10)])
def test_mxfp4_rows_and_matmul_bit_for_bit(shape):
    w = _mxfp4(*shape)
    ref = w.dequantize()
    # the definition: low nibble first, value * 2**(e - 127)
    b, e = int(w.blocks[3, 0]), int(w.scales[3, 0])
    assert ref[3, 0] == kernels.E2M1[b & 15] * 2.0 ** (e - 127)
    assert ref[3, 1] == kernels.E2M1[b >> 4] * 2.0 ** (e - 127)
    np.testing.assert_array_equal(w.rows(np.arange(shape[0])), ref)
    x = np.random.default_rng(2).standard_normal((6, shape[1])).astype(np.float32)
    out = w.matmul(x)
    np.testing.assert_array_equal(out, matmul_f32(x, ref))
    np.testing.assert_array_equal(w.matmul(x[2:3]), out[2:3])
    assert w.bits_per_weight == 4.25


def test_mxfp4_matches_transformers_dequantization():
    torch = pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = _mxfp4(24, 64)
    ref = convert_moe_packed_tensors(torch.from_numpy(w.blocks.reshape(1, 24, 2, 16).copy()),
                                     torch.from_numpy(w.scales.reshape(1, 24, 2).copy()), dtype=torch.float32)
    np.testing.assert_array_equal(w.dequantize(), ref[0].T.numpy())     # transformers gives [in, out]
