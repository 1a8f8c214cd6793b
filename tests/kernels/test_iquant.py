"""IQ4_NL and IQ4_XS kernels (engine/kernels/iquant.py) against gguf's numpy dequantization and plain numpy products."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.quant import KQuantTensor
from support.kquant_blocks import IQ_TYPES, quantize_k, random_k_blocks

pytestmark = pytest.mark.xdist_group("kquant")   # one worker compiles the K-quant kernels (tests/conftest.py)

Q = gguf.GGMLQuantizationType


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality of float32 arrays (signed zeros and all)."""
    return a.shape == b.shape and np.array_equal(a.astype(np.float32).view(np.uint32), b.astype(np.float32).view(np.uint32))


def _reference(raw: np.ndarray, qtype, shape) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(shape)


@pytest.mark.parametrize("qtype", IQ_TYPES)
def test_random_blocks_dequantize_bit_for_bit(qtype):
    """Every byte pattern (scales of either sign, every 6-bit sub-block scale, every code) decodes as gguf decodes it."""
    rng = np.random.default_rng(int(qtype))
    raw = random_k_blocks(qtype, 9, 768, rng)
    t = KQuantTensor((9, 768), qtype, raw)
    ref = _reference(raw, qtype, (9, 768))
    assert _bits_equal(t.rows(np.arange(9)), ref)
    assert _bits_equal(t.rows(np.array([7, 0, 7])), ref[[7, 0, 7]])
    assert _bits_equal(t.dequantize(), ref)


@pytest.mark.parametrize("qtype", IQ_TYPES)
def test_quantized_weights_dequantize_bit_for_bit(qtype):
    """Blocks of real-looking weights (the test quantizer) too, and they are close to the weights."""
    w = np.random.default_rng(3).standard_normal((6, 512)).astype(np.float32)
    raw = quantize_k(w, qtype)
    t = KQuantTensor((6, 512), qtype, raw)
    ref = _reference(raw, qtype, w.shape)
    assert _bits_equal(t.rows(np.arange(6)), ref)
    assert np.sqrt(((ref - w) ** 2).mean()) < 0.12


@pytest.mark.parametrize("qtype", IQ_TYPES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 9])
def test_matmul_matches_numpy(qtype, tokens):
    """Decode (1-2 tokens, on the fly) and prefill (a dequantized tile) against float64 numpy; rows not a multiple
    of 4; IQ4_NL with rows of 32-weight blocks that are not whole super-blocks (as llama.cpp writes 576 columns)."""
    rng = np.random.default_rng(tokens)
    cols = 576 if qtype == Q.IQ4_NL else 512
    raw = random_k_blocks(qtype, 23, cols, rng)
    t = KQuantTensor((23, cols), qtype, raw)
    w = _reference(raw, qtype, (23, cols)).astype(np.float64)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    y = t.matmul(x)
    ref = x.astype(np.float64) @ w.T
    assert y.shape == (tokens, 23) and y.dtype == np.float32
    bound = cols * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    assert (np.abs(y - ref) <= bound).all()


@pytest.mark.parametrize("qtype", IQ_TYPES)
def test_matmul_is_bitwise_independent_of_batch(qtype):
    """One token at a time (decode kernel) gives the same bits as a batch (prefill kernel)."""
    rng = np.random.default_rng(11)
    t = KQuantTensor((20, 256), qtype, random_k_blocks(qtype, 20, 256, rng))
    x = rng.standard_normal((7, 256)).astype(np.float32)
    whole = t.matmul(x)
    assert _bits_equal(np.concatenate([t.matmul(x[i:i + 1]) for i in range(7)]), whole)
    assert _bits_equal(np.concatenate([t.matmul(x[:2]), t.matmul(x[2:])]), whole)


def test_bad_shapes_are_refused_with_the_reason():
    raw = random_k_blocks(Q.IQ4_XS, 4, 256, np.random.default_rng(0))
    with pytest.raises(ValueError, match="multiple of 256"):
        KQuantTensor((4, 128), Q.IQ4_XS, raw)
    with pytest.raises(ValueError, match="does not match its shape and type"):
        KQuantTensor((4, 256), Q.IQ4_NL, raw)
    assert KQuantTensor((4, 32), Q.IQ4_NL, random_k_blocks(Q.IQ4_NL, 4, 32, np.random.default_rng(1))).nbytes == 72
