"""A GGUF's K-quant experts kept as published in a container stream from disk under a budget: greedy output and every
logit are byte-identical to the resident container and to the GGUF run directly, through the blocks and through
the fused step, which runs the streamed K-quant experts itself."""

from __future__ import annotations

import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.fused import kernel as fk
from engine.fused.plan import FusedDecode
from engine.kernels.kquant import KQUANT_FLAG
from engine.loader import OffloadOptions, load_model
from engine.offload.store import StoreSettings
from engine.quant import KQuantTensor
from support.gguf_writer import kquant_moe_gguf
from support.offload import greedy_logits

PROMPT = [3, 17, 5, 99, 42, 8, 23, 61, 7, 150, 12, 33]
STEPS = 8
N_EXPERTS, TOP_K = 8, 2


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """(the container kept as published, the GGUF's own greedy run: logits and tokens)."""
    folder = tmp_path_factory.mktemp("gguf")
    path = kquant_moe_gguf(folder, num_experts=N_EXPERTS)
    out = convert(path, folder / "container", ConvertSettings(), log=lambda m: None)
    direct = load_model(path)
    try:
        return out, greedy_logits(direct, PROMPT, STEPS)
    finally:
        direct.close()


def _streamed(out, slots: int, io: str = "pread", depth: int = 1):
    probe = load_model(out, offload=OffloadOptions(StoreSettings(capacity=1 << 30)))
    slot = probe.store.slot_bytes
    probe.close()
    return load_model(out, offload=OffloadOptions(StoreSettings(capacity=slots * slot, io=io, policy="lru"), depth))


@pytest.mark.parametrize("io, depth", [("pread", 1), ("mmap", 0), ("pread", 2)])
def test_streamed_k_quant_experts_give_the_gguf_bytes(kept, io, depth):
    out, (want, want_tokens) = kept
    resident = load_model(out)
    try:
        assert greedy_logits(resident, PROMPT, STEPS)[1] == want_tokens
    finally:
        resident.close()
    loaded = _streamed(out, TOP_K + 1, io, depth)            # a few of the 16 experts' slots: most steps read
    try:
        experts = loaded.store.experts(0, [0])
        assert all(isinstance(m, KQuantTensor) for m in (experts[0].gate, experts[0].up, experts[0].down))
        logits, tokens = greedy_logits(loaded, PROMPT, STEPS)
        stats = loaded.store.stats()
        plan = loaded.model.context.fused
    finally:
        loaded.close()
    assert tokens == want_tokens
    assert np.array_equal(logits.view(np.uint32), want.view(np.uint32))
    assert stats.hits["disk"] > 0 and stats.occupancy["pinned"] + stats.occupancy["cached"] <= (TOP_K + 1) * stats.slot_bytes
    # the fused step ran the decode steps, its streamed layers' K-quant experts brought in by the store
    assert isinstance(plan, FusedDecode) and plan.kquant is True
    assert plan.lay[:, fk.L_STREAMED].sum() == 2
    assert (plan.descs[:, 0] == KQUANT_FLAG).any()


def test_streamed_k_quant_experts_fused_equal_the_blocks(kept):
    out, (want, want_tokens) = kept
    loaded = _streamed(out, TOP_K + 1)
    try:
        loaded.model.context.fused_decode = False
        blocks, block_tokens = greedy_logits(loaded, PROMPT, STEPS)
        assert loaded.model.context.fused is False                   # never built: the blocks ran every step
    finally:
        loaded.close()
    assert block_tokens == want_tokens
    assert np.array_equal(blocks.view(np.uint32), want.view(np.uint32))
