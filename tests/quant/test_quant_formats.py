"""Formats and the scale search: round-trip error per width, what the search and importance buy, layout."""

from __future__ import annotations

import numpy as np
import pytest

from engine.kernels.layout import FORMATS, f16_values, pack_codes, unpack_codes
from engine.quant import BITS, GROUPS, quantize, weighted_error

# Relative RMS error bounds on Gaussian weights (measured: 8b 0.005-0.006, 6b 0.020-0.025,
# 5b 0.040-0.049, 4b 0.081-0.095, 3b 0.163-0.187, 2b (zero points) 0.30-0.34 over groups 32-128)
REL_RMS_BOUND = {8: 0.0075, 6: 0.029, 5: 0.056, 4: 0.105, 3: 0.205, 2: 0.37}


def _gauss(rows=64, cols=512, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def _rel_rms(w: np.ndarray, q) -> float:
    return float(np.sqrt(weighted_error(w, q) / (w.astype(np.float64) ** 2).sum()))


def _importance(cols: int, seed: int = 1) -> np.ndarray:
    # activation energy spread over three orders of magnitude, as real channels are
    return np.exp(np.random.default_rng(seed).uniform(-3.5, 3.5, cols)).astype(np.float32)


@pytest.mark.parametrize("group", GROUPS)
def test_round_trip_error_bounded_and_monotone_in_bits(group):
    w = _gauss()
    errors = {}
    for bits in BITS:
        q = quantize(w, bits, group)
        assert q.shape == w.shape and q.bits == bits and q.group == group
        errors[bits] = _rel_rms(w, q)
        assert errors[bits] < REL_RMS_BOUND[bits], (bits, group, errors[bits])
    ordered = [errors[b] for b in sorted(BITS)]
    assert ordered == sorted(ordered, reverse=True), errors


def test_smaller_groups_give_less_error():
    w = _gauss()
    for bits in BITS:
        e = [_rel_rms(w, quantize(w, bits, g)) for g in GROUPS]
        assert e[0] < e[1] < e[2], (bits, e)


@pytest.mark.parametrize("bits", BITS)
def test_bits_per_weight_counts_codes_scales_and_offsets(bits):
    for group in GROUPS:
        q = quantize(_gauss(8, 256), bits, group)
        per_group = 16 * (2 if q.asymmetric else 1)
        assert q.bits_per_weight == pytest.approx(bits + per_group / group)
        assert q.nbytes == q.a.nbytes + q.b.nbytes + q.scales.nbytes + q.mins.nbytes


@pytest.mark.parametrize("bits", BITS)
def test_clip_search_beats_absmax(bits):
    w = _gauss(seed=bits)
    imp = _importance(w.shape[1])
    for group in (32, 128):
        searched = weighted_error(w, quantize(w, bits, group, importance=imp), imp)
        absmax = weighted_error(w, quantize(w, bits, group, importance=imp, clip_search=False), imp)
        assert searched < absmax * (0.97 if bits < 8 else 0.999), (bits, group, searched / absmax)


@pytest.mark.parametrize("bits", BITS)
def test_importance_weighting_beats_uniform_on_the_weighted_error(bits):
    w = _gauss(seed=10 + bits)
    imp = _importance(w.shape[1], seed=bits)
    weighted = weighted_error(w, quantize(w, bits, 32, importance=imp), imp)
    uniform = weighted_error(w, quantize(w, bits, 32), imp)
    assert weighted < uniform * 0.99, (bits, weighted / uniform)


@pytest.mark.parametrize("bits", [2, 3])
def test_zero_points_beat_symmetric_at_low_bits(bits):
    # at the same group size; per byte they pay off at 2 bits only, hence the defaults
    for w in (_gauss(seed=3), np.abs(_gauss(seed=4)) + 0.3 * _gauss(seed=5)):
        for group in GROUPS:
            asym = _rel_rms(w, quantize(w, bits, group, asymmetric=True))
            sym = _rel_rms(w, quantize(w, bits, group, asymmetric=False))
            assert asym < sym, (bits, group, asym, sym)
    assert FORMATS[2].asymmetric and not FORMATS[3].asymmetric


def test_symmetric_dequantization_is_exact_code_times_scale():
    w = _gauss(16, 128)
    for bits in (8, 6, 5, 4, 3):
        q = quantize(w, bits, 64, layout="planes")      # the plane layout's codes, unpacked as they are stored
        u = unpack_codes(q.a, q.b, bits, 128).astype(np.float64)
        d = np.repeat(f16_values(q.scales).astype(np.float64), 64, axis=1)
        assert np.array_equal(q.dequantize().astype(np.float64), d * (u - 2 ** (bits - 1)))


def test_quantization_is_deterministic_and_handles_constant_groups():
    w = _gauss(6, 128)
    w[0] = 0.0
    w[1, :32] = 0.25
    for bits in BITS:
        q1, q2 = quantize(w, bits, 32), quantize(w, bits, 32)
        assert all(np.array_equal(x, y) for x, y in zip(q1.to_buffers()[1].values(), q2.to_buffers()[1].values()))
        dq = q1.dequantize()
        assert (dq[0] == 0).all()
        assert np.allclose(dq[1, :32], 0.25, rtol=1e-3), bits


@pytest.mark.parametrize("bits", BITS)
def test_pack_unpack_round_trip(bits):
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (5, 96), dtype=np.uint8)
    a, b = pack_codes(codes, bits)
    fmt = FORMATS[bits]
    assert a.shape == (5, 3 * fmt.a_bytes) and b.shape == (5, 3 * fmt.b_bytes)
    assert np.array_equal(unpack_codes(a, b, bits, 96), codes)


def test_layout_places_weights_as_documented():
    codes = np.zeros((1, 32), np.uint8)
    codes[0, 16 + 3] = 0b101101            # weight 19 of the block, 6 bits
    a, b = pack_codes(codes, 6)
    assert a[0, 3] == (0b1101 << 4)          # nibble plane: byte j, high nibble = weight 16 + j
    word1 = int.from_bytes(b[0, 4:8].tobytes(), "little")
    assert word1 == 0b10 << (2 * 3)          # crumb plane: word 1 holds weights 16.., 2 bits each
    a, b = pack_codes(codes & 7, 3)          # 3 bits: crumb plane + bit plane
    assert int.from_bytes(b[0, :4].tobytes(), "little") == 1 << 19


def test_bad_quantize_arguments_are_named():
    w = _gauss(4, 64)
    with pytest.raises(ValueError, match="bit width 7"):
        quantize(w, 7, 32)
    with pytest.raises(ValueError, match="group size 48"):
        quantize(w, 4, 48)
    with pytest.raises(ValueError, match="not a multiple of the group size 128"):
        quantize(w, 4, 128)
    with pytest.raises(ValueError, match="floating point"):
        quantize(w.astype(np.int32), 4, 32)
    with pytest.raises(ValueError, match=r"\[out, in\]"):
        quantize(w[0], 4, 32)
    bad = w.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        quantize(bad, 4, 32)
    with pytest.raises(ValueError, match=r"importance has shape \[32\], expected \[64\]"):
        quantize(w, 4, 32, importance=np.ones(32))
    with pytest.raises(ValueError, match=">= 0"):
        quantize(w, 4, 32, importance=-np.ones(64))
    with pytest.raises(ValueError, match="fp16"):
        quantize(w * 1e9, 4, 32)
    with pytest.raises(ValueError, match="shape"):
        weighted_error(w[:2], quantize(w, 4, 32))


@pytest.mark.parametrize("bits,asymmetric", [(2, True), (3, False), (4, True), (4, False), (8, False)])
def test_quantized_error_is_the_weighted_error_of_the_quantized_tensor(bits, asymmetric):
    """The planner's error without codes: the same search, fp16 scales and rounding as quantize()."""
    from engine.quant.tensor import quantized_error

    w, imp = _gauss(48, 256, seed=bits), _importance(256)
    for importance in (None, imp):
        expected = weighted_error(w, quantize(w, bits, 64, importance=importance, asymmetric=asymmetric), importance)
        got = quantized_error(w, bits, 64, importance=importance, asymmetric=asymmetric)
        assert got == pytest.approx(expected, rel=1e-9)
