"""Fused routed experts against a per-expert numpy loop; invariant to batch, co-routed tokens and threads."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from engine.blocks.ffn import ExpertWeights
from engine.kernels.experts import moe_experts
from engine.quant import quantize
from support.kernels import fma32, quant_dot

HIDDEN, INTER, N_EXPERTS, TOP_K = 128, 96, 6, 3
BITS_OF = (4, 8, 3, 2, 5, 6)  # every format, one per expert, groups varying too


def _experts(seed: int = 0) -> dict[int, ExpertWeights]:
    rng = np.random.default_rng(seed)

    def mat(rows, cols, bits, group):
        return quantize((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), bits, group)

    return {e: ExpertWeights(mat(INTER, HIDDEN, b, 32), mat(INTER, HIDDEN, b, 64), mat(HIDDEN, INTER, b, 32))
            for e, b in enumerate(BITS_OF)}


def _routing(t: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, HIDDEN)).astype(np.float32)
    ids = np.stack([rng.choice(N_EXPERTS, TOP_K, replace=False) for _ in range(t)]).astype(np.int64)
    weights = rng.random((t, TOP_K)).astype(np.float32)
    return x, ids, weights


def _reference(x, ids, weights, experts) -> np.ndarray:
    """Per token and slot: the kernels' exact dots (quant_dot), numpy's SiLU, slots summed in order."""
    out = np.zeros((x.shape[0], HIDDEN), np.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = experts[int(ids[t, k])]
            g = quant_dot(e.gate, x[t:t + 1])
            u = quant_dot(e.up, x[t:t + 1])
            h = (g / (np.float32(1) + np.exp(-g))) * u
            out[t] = fma32(weights[t, k], quant_dot(e.down, h)[0], out[t])
    return out


@pytest.fixture(scope="module")
def experts():
    return _experts()


@pytest.mark.parametrize("t", [1, 3, 17, 128])
def test_fused_experts_match_per_expert_numpy(experts, t):
    x, ids, weights = _routing(t, t)
    got = moe_experts(x, ids, weights, experts)
    want = _reference(x[:20], ids[:20], weights[:20], experts)   # the first 20 tokens keep the loop fast
    # only numpy's float32 exp differs from libm's (by an ulp or so), and that difference passes
    # through the down projection: a relative tolerance of a few float32 ulps of the output scale
    scale = np.abs(want).max()
    assert np.abs(got[:20] - want).max() <= 1e-6 * scale
    # and the fused call equals the single-matrix kernels composed (same dots, same SiLU inputs)
    e0 = experts[int(ids[0, 0])]
    assert np.array_equal(e0.gate.matmul(x[:1]), quant_dot(e0.gate, x[:1]))


def test_fused_experts_are_invariant_to_batch_and_threads(experts):
    x, ids, weights = _routing(96, 7)
    full = moe_experts(x, ids, weights, experts)
    before = numba.get_num_threads()
    try:
        for n in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(n)
            assert np.array_equal(moe_experts(x, ids, weights, experts), full)
            for t in (0, 1, 50, 95):
                assert np.array_equal(moe_experts(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], experts)[0], full[t])
            for start, size in ((0, 2), (3, 5), (10, 17), (30, 64)):
                part = slice(start, start + size)
                assert np.array_equal(moe_experts(x[part], ids[part], weights[part], experts), full[part])
    finally:
        numba.set_num_threads(before)
    # a token's output does not depend on which other tokens chose its experts
    crowd = np.repeat(ids[:1], 40, axis=0)
    together = moe_experts(np.repeat(x[:1], 40, axis=0), crowd, np.repeat(weights[:1], 40, axis=0), experts)
    assert (together == full[0]).all()


def test_fused_experts_take_a_list_and_a_sparse_mapping(experts):
    x, ids, weights = _routing(5, 3)
    as_list = [experts[e] for e in range(N_EXPERTS)]
    chosen = {int(e): experts[int(e)] for e in np.unique(ids)}
    full = moe_experts(x, ids, weights, experts)
    assert np.array_equal(moe_experts(x, ids, weights, as_list), full)
    assert np.array_equal(moe_experts(x, ids, weights, chosen), full)


def test_bad_fused_inputs_are_named(experts):
    x, ids, weights = _routing(4, 1)
    with pytest.raises(ValueError, match="no weights were given"):
        moe_experts(x, ids, weights, {0: experts[0]})
    with pytest.raises(ValueError, match="float32 of the ids' shape"):
        moe_experts(x, ids, weights.astype(np.float64), experts)
    with pytest.raises(ValueError, match=r"integer \[T, K\]"):
        moe_experts(x, ids.astype(np.float32), weights, experts)
    with pytest.raises(ValueError, match=">= 0"):
        moe_experts(x, -ids, weights, [experts[e] for e in range(N_EXPERTS)])
    with pytest.raises(ValueError, match="4 tokens but the routing 2"):
        moe_experts(x, ids[:2], weights[:2], experts)
    with pytest.raises(ValueError, match="float32"):
        moe_experts(x.astype(np.float64), ids, weights, experts)
    dense = {e: ExpertWeights(w.gate.dequantize(), w.up.dequantize(), w.down.dequantize()) for e, w in experts.items()}
    with pytest.raises(ValueError, match="quantized experts only"):
        moe_experts(x, ids, weights, dense)
    wrong = dict(experts)
    wrong[int(ids[0, 0])] = ExpertWeights(experts[0].gate, experts[0].up, experts[0].gate)
    with pytest.raises(ValueError, match="do not fit"):
        moe_experts(x, ids, weights, wrong)


@pytest.mark.parametrize("t", [1, 5, 40])
def test_slots_in_parts_give_the_same_bits(experts, t):
    """A streamed layer step runs resident experts first and the rest as reads finish: same bits as one call."""
    from engine.kernels.experts import expert_outputs, weighted_sum

    x, ids, weights = _routing(t, 100 + t)
    whole = moe_experts(x, ids, weights, experts)
    rng = np.random.default_rng(t)
    groups = rng.permutation(N_EXPERTS)
    first, second = set(groups[:2].tolist()), set(groups[2:].tolist())
    y = np.full((t * TOP_K, HIDDEN), np.nan, np.float32)
    for part in (second, first):
        slots = np.nonzero(np.isin(ids.reshape(-1), list(part)))[0]
        expert_outputs(x, ids, {e: experts[e] for e in part}, slots, y)
    assert not np.isnan(y).any()
    assert np.array_equal(weighted_sum(y, weights, np.zeros((t, HIDDEN), np.float32)), whole)
