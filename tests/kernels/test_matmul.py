"""Quantized and float32 matmul kernels: bitwise against the numpy reference, batch- and thread-invariant."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from engine.kernels import matmul as kernels
from engine.kernels.fp32 import matmul_f32
from engine.quant import BITS, QuantizedTensor, matmul_many, quantize
from support.kernels import acts, lane_dot, weights

TOKENS = (1, 2, 3, 17, 128)  # 1 and 2 take the on-the-fly (decode) path, 3 (a padded tile), 17 and 128 the tile path


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("asym", [False, True])
def test_matmul_matches_reference_bitwise(bits, asym):
    # odd row counts (no multiple of the 4-row tile), several groups per row
    for rows, cols, group in ((37, 256, 32), (37, 256, 64), (41, 256, 128), (6, 96, 32)):
        q = quantize(weights(rows, cols, bits), bits, group, asymmetric=asym)
        w = q.dequantize()
        for t in TOKENS:
            x = acts(t, cols, t)
            assert np.array_equal(q.matmul(x), lane_dot(w, x)), (rows, cols, group, t)


@pytest.mark.parametrize("bits", BITS)
def test_kernel_dequantization_equals_numpy_dequantize(bits):
    q = quantize(weights(9, 128, 0), bits, 64, asymmetric=bits <= 3)
    a, b, sc, mn = (arr.reshape(-1) for arr in (q.a, q.b, q.scales, q.mins))
    dst = np.empty(9 * 128, np.float32)
    for r0 in range(0, 9, 4):
        nr = min(4, 9 - r0)
        kernels.dequant_rows(bits, q.asymmetric, 64, a, b, sc, mn, 128, r0, nr, dst[r0 * 128:])
    assert np.array_equal(dst.reshape(9, 128), q.dequantize())


@pytest.mark.parametrize("bits", [4, 8, 2])
def test_matmul_is_batch_and_thread_invariant(bits, threads):
    q = quantize(weights(70, 384, 1), bits, 32)
    x = acts(128, 384, 2)
    results = []
    for n in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        threads(n)
        full = q.matmul(x)
        results.append(full)
        for t in (0, 1, 63, 127):
            assert np.array_equal(q.matmul(x[t:t + 1])[0], full[t]), (n, t)
        for start, size in ((0, 2), (5, 3), (9, 4), (20, 5), (40, 17), (1, 127)):
            assert np.array_equal(q.matmul(x[start:start + size]), full[start:start + size]), (n, start, size)
    assert all(np.array_equal(r, results[0]) for r in results)


def test_matmul_many_equals_each_matmul():
    # q, k, v of different widths and formats sharing one input, in one parallel call
    tensors = [quantize(weights(rows, 128, rows), bits, 32) for rows, bits in ((64, 4), (17, 8), (17, 2), (5, 6))]
    for t in (1, 3, 20):
        x = acts(t, 128, t)
        outs = matmul_many(x, tensors)
        assert [o.shape for o in outs] == [(t, q.shape[0]) for q in tensors]
        assert all(np.array_equal(o, q.matmul(x)) for o, q in zip(outs, tensors))
    with pytest.raises(ValueError, match="share an input width"):
        matmul_many(acts(1, 128, 0), [tensors[0], quantize(weights(4, 64, 0), 4, 32)])


def test_matmul_of_zero_rows_and_tokens():
    w = weights(12, 64, 3)
    w[5] = 0.0
    q = quantize(w, 4, 32)
    y = q.matmul(acts(4, 64, 4))
    assert (y[:, 5] == 0).all()
    assert q.matmul(np.zeros((0, 64), np.float32)).shape == (0, 12)


@pytest.mark.parametrize("rows,cols", [(1024 // 16, 1024 // 8), (37, 83), (5, 16), (3, 7)])
def test_matmul_f32_matches_reference_bitwise(rows, cols):
    w = weights(rows, cols, rows)
    for t in TOKENS:
        x = acts(t, cols, t)
        assert np.array_equal(matmul_f32(x, w), lane_dot(w, x)), (rows, cols, t)


def test_matmul_f32_is_batch_and_thread_invariant(threads):
    w = weights(45, 200, 5)
    x = acts(33, 200, 6)
    full = matmul_f32(x, w)
    for n in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        threads(n)
        assert np.array_equal(matmul_f32(x, w), full)
        for t in range(33):
            assert np.array_equal(matmul_f32(x[t:t + 1], w)[0], full[t])


def test_matmul_f32_takes_read_only_and_strided_weights():
    w = weights(20, 48, 7)
    x = acts(5, 48, 8)
    ro = w.copy()
    ro.flags.writeable = False
    assert np.array_equal(matmul_f32(x, ro), lane_dot(w, x))
    wide = np.zeros((20, 96), np.float32)
    wide[:, ::2] = w
    assert np.array_equal(matmul_f32(x, wide[:, ::2]), lane_dot(w, x))


def test_bad_activations_are_named():
    q = quantize(weights(8, 64, 9), 4, 32)
    with pytest.raises(ValueError, match="float32"):
        q.matmul(np.zeros((2, 64), np.float64))
    with pytest.raises(ValueError, match=r"expected \[T, 64\]"):
        q.matmul(np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match=r"expected \[T, 64\]"):
        q.matmul(np.zeros(64, np.float32))
    with pytest.raises(ValueError, match="numpy array"):
        q.matmul([[0.0] * 64])
    with pytest.raises(ValueError, match="float32"):
        matmul_f32(np.zeros((1, 4), np.float32), np.zeros((3, 4), np.float64))
    with pytest.raises(ValueError, match=r"expected \[T, 4\]"):
        matmul_f32(np.zeros((1, 5), np.float32), np.zeros((3, 4), np.float32))


_PORTABLE_SCRIPT = """
import sys
import numpy as np
from engine.kernels import simd
from engine.kernels.fp32 import matmul_f32
from engine.quant import QuantizedTensor
from engine.kernels.layout import FORMATS, f16_bits


def products():
    # random codes and scales (not quantize(): its search may round differently on another CPU)
    rng = np.random.default_rng(0)
    parts = []
    for bits, fmt in FORMATS.items():
        planes = [rng.integers(0, 256, (37, 8 * n), dtype=np.uint8) for n in (fmt.a_bytes, fmt.b_bytes)]
        scales, mins = (f16_bits(rng.uniform(-0.02, 0.02, (37, 4))) for _ in range(2))
        for asym in (False, True):
            q = QuantizedTensor((37, 256), bits, 64, asym, *planes, scales, mins if asym else np.zeros((37, 0), np.uint16))
            x = rng.standard_normal((5, 256)).astype(np.float32)
            parts += [q.matmul(x), q.matmul(x[:1]), q.matmul(x[:2])]
    # the rows16 layout's integer kernels (vpdpbusd here, plain widening multiplies there)
    a = rng.integers(0, 256, (48, 128), dtype=np.uint8)
    q = QuantizedTensor((48, 256), 4, 64, False, a, np.zeros((48, 0), np.uint8), f16_bits(rng.uniform(-0.02, 0.02, (48, 4))),
                        np.zeros((48, 0), np.uint16)).with_layout("rows16")
    x = rng.standard_normal((6, 256)).astype(np.float32)
    parts += [q.matmul(x), q.matmul(x[:1])]
    w = rng.standard_normal((9, 83)).astype(np.float32)
    parts.append(matmul_f32(rng.standard_normal((3, 83)).astype(np.float32), w))
    return np.concatenate([p.ravel() for p in parts]).tobytes().hex()


if __name__ == "__main__":
    assert not simd.HAS_AVX512
    sys.stdout.write(products())
"""


@pytest.mark.slow
def test_generic_cpu_build_gives_the_same_bits():
    # the kernels compiled for a baseline x86-64 (no AVX, no FMA unit, no table permutes) must
    # reproduce this machine's results bit for bit: hardware changes speed, never the answer
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "NUMBA_CPU_NAME": "generic", "NUMBA_CACHE_DIR": str(repo / ".cache" / "numba-generic")}
    run = subprocess.run([sys.executable, "-c", _PORTABLE_SCRIPT], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    here = {}
    exec(_PORTABLE_SCRIPT.replace('if __name__ == "__main__":', "if False:"), here)
    assert run.stdout == here["products"]()


def test_quantized_tensor_works_through_linear():
    from engine.blocks.linear import linear

    q = quantize(weights(10, 64, 10), 5, 32)
    x = acts(3, 64, 11)
    assert isinstance(q, QuantizedTensor)
    assert np.array_equal(linear(x, q), q.matmul(x))
