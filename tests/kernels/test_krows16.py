"""GGUF Q4_K, Q5_K, Q6_K and IQ4_XS in the 16-row layout and its integer kernels (engine/kernels/krows16.py): the layout keeps every
byte, the kernels equal a plain numpy reference of their arithmetic bit for bit, and any tokens, row ranges,
threads or descriptor path give the same bits."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.kernels import krows16
from engine.kernels.kquant import KQUANT_FLAG, kq_desc_rows
from engine.quant import KQuantTensor
from support.kernels import acts, krows16_dot
from support.kquant_blocks import quantize_k, random_k_blocks

Q = gguf.GGMLQuantizationType
TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)


@pytest.mark.parametrize("qtype", TYPES)
def test_the_layout_is_a_reordering_that_keeps_every_byte(qtype):
    raw = random_k_blocks(qtype, 48, 512, np.random.default_rng(1))
    t = KQuantTensor((48, 512), qtype, raw)
    r = t.with_layout("rows16")
    assert r.layout == "rows16" and r.raw.shape == raw.shape and r.nbytes == t.nbytes
    assert not np.array_equal(r.raw, raw) and np.array_equal(r.blocks, raw)
    assert np.array_equal(r.dequantize(), t.dequantize())
    ids = np.array([0, 15, 16, 47, 3, 16])
    assert np.array_equal(r.rows(ids), t.dequantize()[ids])
    expert = r.take_rows(slice(16, 32))                                  # whole row blocks: still rows16, a view
    assert expert.layout == "rows16" and np.shares_memory(expert.raw, r.raw)
    assert np.array_equal(expert.dequantize(), t.dequantize()[16:32])
    cut = r.take_rows(np.array([5, 2, 40]))                              # any rows: back in the file's order
    assert cut.layout == "blocks" and np.array_equal(cut.raw, raw[[5, 2, 40]])
    meta, buffers = r.to_buffers()
    assert meta["layout"] == "rows16-v1"
    again = KQuantTensor.from_buffers(meta, buffers)
    assert again.layout == "rows16" and np.array_equal(again.raw, r.raw)
    assert r.with_layout("blocks").layout == "blocks" and np.array_equal(r.with_layout("blocks").raw, raw)


def test_only_k_quants_and_iq4_xs_of_whole_row_blocks_take_the_layout():
    rng = np.random.default_rng(2)
    with pytest.raises(ValueError, match="rows16 layout holds Q4_K, Q5_K, Q6_K and IQ4_XS matrices of whole 16-row blocks"):
        KQuantTensor((24, 256), Q.Q4_K, random_k_blocks(Q.Q4_K, 24, 256, rng), "rows16")
    with pytest.raises(ValueError, match="rows16 layout holds Q4_K, Q5_K, Q6_K and IQ4_XS"):
        KQuantTensor((16, 256), Q.Q3_K, random_k_blocks(Q.Q3_K, 16, 256, rng), "rows16")
    with pytest.raises(ValueError, match="unknown K-quant layout"):
        KQuantTensor((16, 256), Q.Q4_K, random_k_blocks(Q.Q4_K, 16, 256, rng), "tiles")
    meta, buffers = KQuantTensor((16, 256), Q.Q4_K, random_k_blocks(Q.Q4_K, 16, 256, rng)).to_buffers()
    with pytest.raises(ValueError, match="upgrade Colibri, or convert the model again"):
        KQuantTensor.from_buffers(meta | {"layout": "rows32-v9"}, buffers)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows, cols", [(16, 256), (48, 512), (32, 1024)])
def test_matmul_matches_the_reference_bitwise(qtype, rows, cols):
    raw = random_k_blocks(qtype, rows, cols, np.random.default_rng(rows + cols))
    t = KQuantTensor((rows, cols), qtype, raw).with_layout("rows16")
    for n in (1, 2, 3, 4, 5, 8, 9):
        x = acts(n, cols, n)
        assert np.array_equal(t.matmul(x), krows16_dot(qtype.name, raw, x)), n


@pytest.mark.parametrize("qtype", TYPES)
def test_any_rows_tokens_threads_and_descriptors_give_the_same_bits(qtype, threads):
    raw = random_k_blocks(qtype, 80, 512, np.random.default_rng(3))
    t = KQuantTensor((80, 512), qtype, raw).with_layout("rows16")
    x = acts(11, 512, 4)
    whole = t.matmul(x)
    assert np.array_equal(np.concatenate([t.matmul(x[i:i + 1]) for i in range(11)]), whole)
    threads(1)
    assert np.array_equal(t.matmul(x), whole)
    desc = t.descriptor_row
    assert desc[0] == KQUANT_FLAG and desc[1] == int(qtype) | krows16.KROWS16
    out = np.full(2 * 80, np.nan, np.float32)
    for r0, r1 in ((0, 5), (5, 21), (21, 64), (64, 80)):         # the fused step's chunks cut row blocks anywhere
        kq_desc_rows(desc, r0, r1 - r0, x.reshape(-1), np.array([3, 7]), np.array([0, 1]), 0, 2, out, 80, r0)
    assert np.array_equal(out.reshape(2, 80), whole[[3, 7]])


@pytest.mark.parametrize("qtype", TYPES)
def test_the_integer_path_stays_close_to_the_files_weights(qtype):
    # 8-bit activations per 32-block: close to the float product of the dequantized weights, not equal
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((64, 1024)) * 0.05).astype(np.float32)
    raw = quantize_k(w, qtype)
    t = KQuantTensor((64, 1024), qtype, raw)
    x = acts(3, 1024, 6)
    exact = x.astype(np.float64) @ t.dequantize().T.astype(np.float64)
    err = np.abs(t.with_layout("rows16").matmul(x) - exact).max() / np.abs(exact).max()
    assert 0 < err < 0.02
