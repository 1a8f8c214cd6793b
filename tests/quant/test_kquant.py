"""K-quant kernels (engine/kernels/kquant.py) against gguf's numpy dequantization and plain numpy products."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.quant import KQuantTensor, QuantizedTensor, matmul_many, quantize
from support.kquant_blocks import TYPES, quantize_k, random_k_blocks

pytestmark = pytest.mark.xdist_group("kquant")   # one worker compiles the K-quant kernels (tests/conftest.py)

Q = gguf.GGMLQuantizationType


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality of float32 arrays (signed zeros and all)."""
    return a.shape == b.shape and np.array_equal(a.astype(np.float32).view(np.uint32), b.astype(np.float32).view(np.uint32))


def _reference(raw: np.ndarray, qtype, shape) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(shape)


@pytest.mark.parametrize("qtype", TYPES)
def test_random_blocks_dequantize_bit_for_bit(qtype):
    """Every byte pattern (scales of either sign, zeros, the top sub-scale bits) decodes as gguf decodes it."""
    rng = np.random.default_rng(int(qtype))
    raw = random_k_blocks(qtype, 9, 768, rng)
    t = KQuantTensor((9, 768), qtype, raw)
    ref = _reference(raw, qtype, (9, 768))
    assert _bits_equal(t.rows(np.arange(9)), ref)
    assert _bits_equal(t.rows(np.array([7, 0, 7])), ref[[7, 0, 7]])
    assert _bits_equal(t.dequantize(), ref)


@pytest.mark.parametrize("qtype", TYPES)
def test_quantized_weights_dequantize_bit_for_bit(qtype):
    """Blocks of real-looking weights (the test quantizer) too, and they are close to the weights."""
    w = np.random.default_rng(3).standard_normal((6, 512)).astype(np.float32)
    raw = quantize_k(w, qtype)
    t = KQuantTensor((6, 512), qtype, raw)
    ref = _reference(raw, qtype, w.shape)
    assert _bits_equal(t.rows(np.arange(6)), ref)
    assert np.sqrt(((ref - w) ** 2).mean()) < {Q.Q2_K: 0.4, Q.Q3_K: 0.25}.get(qtype, 0.1)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 9])
def test_matmul_matches_numpy(qtype, tokens):
    """Decode (1-2 tokens, on the fly) and prefill (a dequantized tile) against float64 numpy; rows not a multiple of 4."""
    rng = np.random.default_rng(tokens)
    raw = random_k_blocks(qtype, 23, 512, rng)
    t = KQuantTensor((23, 512), qtype, raw)
    w = _reference(raw, qtype, (23, 512)).astype(np.float64)
    x = rng.standard_normal((tokens, 512)).astype(np.float32)
    y = t.matmul(x)
    ref = x.astype(np.float64) @ w.T
    assert y.shape == (tokens, 23) and y.dtype == np.float32
    # float32 accumulation of 512 products: error bounded by a few ulps of sum |w x|
    bound = 512 * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    assert (np.abs(y - ref) <= bound).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_matmul_is_bitwise_independent_of_batch(qtype):
    """One token at a time (decode kernel) gives the same bits as a batch (prefill kernel)."""
    rng = np.random.default_rng(11)
    t = KQuantTensor((20, 256), qtype, random_k_blocks(qtype, 20, 256, rng))
    x = rng.standard_normal((7, 256)).astype(np.float32)
    whole = t.matmul(x)
    assert _bits_equal(np.concatenate([t.matmul(x[i:i + 1]) for i in range(7)]), whole)
    assert _bits_equal(np.concatenate([t.matmul(x[:2]), t.matmul(x[2:])]), whole)


def test_matmul_many_runs_k_quants_together_and_mixed():
    """q, k, v of a Q4_K_M (Q4_K, Q4_K, Q6_K) in one call, and a mix with a QuantizedTensor, equal their own products."""
    rng = np.random.default_rng(5)
    mats = [KQuantTensor((12, 512), Q.Q4_K, random_k_blocks(Q.Q4_K, 12, 512, rng)),
            KQuantTensor((8, 512), Q.Q4_K, random_k_blocks(Q.Q4_K, 8, 512, rng)),
            KQuantTensor((8, 512), Q.Q6_K, random_k_blocks(Q.Q6_K, 8, 512, rng))]
    for tokens in (1, 5):
        x = rng.standard_normal((tokens, 512)).astype(np.float32)
        for y, m in zip(matmul_many(x, mats), mats):
            assert _bits_equal(y, m.matmul(x))
    plain = quantize(rng.standard_normal((16, 512)).astype(np.float32), 4, 32)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    mixed = matmul_many(x, [mats[0], plain])
    assert _bits_equal(mixed[0], mats[0].matmul(x)) and _bits_equal(mixed[1], plain.matmul(x))
    assert isinstance(plain, QuantizedTensor)


def test_rows_are_views_of_the_given_bytes():
    """The tensor holds the file's bytes as they are: no copy, read-only; a row slice is a view too."""
    raw = random_k_blocks(Q.Q4_K, 8, 512, np.random.default_rng(0))
    t = KQuantTensor((8, 512), Q.Q4_K, raw)
    assert np.shares_memory(t.raw, raw) and not t.raw.flags.writeable
    assert t.nbytes == raw.nbytes and t.bits_per_weight == 4.5
    part = t.take_rows(slice(2, 6))
    assert np.shares_memory(part.raw, raw) and part.shape == (4, 512)
    assert _bits_equal(part.rows(np.arange(4)), t.rows(np.arange(2, 6)))


def test_bad_input_is_refused_with_the_reason():
    raw = random_k_blocks(Q.Q6_K, 4, 256, np.random.default_rng(0))
    with pytest.raises(ValueError, match="multiple of 256"):
        KQuantTensor((4, 128), Q.Q6_K, raw)
    with pytest.raises(ValueError, match="does not match its shape and type"):
        KQuantTensor((4, 256), Q.Q4_K, raw)
    with pytest.raises(ValueError, match="not a K-quant type"):
        KQuantTensor((4, 256), Q.Q8_0, raw)
    t = KQuantTensor((4, 256), Q.Q6_K, raw)
    with pytest.raises(ValueError, match="expected"):
        t.matmul(np.zeros((1, 255), np.float32))
    with pytest.raises(IndexError):
        t.rows(np.array([4]))
