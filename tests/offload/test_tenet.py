"""The tenet on every MoE family and a dense model: hardware changes speed, never the answer.

Greedy output (and every logit) is byte-identical between all-resident and a budget holding 10% of
the expert bytes, for every prefetch depth, I/O mode and replacement policy.
"""

from __future__ import annotations

import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.loader import OffloadOptions, load_model
from engine.offload.store import StoreSettings
from support.families import FAMILIES
from support.offload import greedy_logits
from support.reference import build_checkpoint

PROMPT = [3, 17, 5, 99, 42, 8, 23, 61, 7, 150, 12, 33]
STEPS = 8
# every depth, I/O mode and policy appears for every family, and each pair of values somewhere
COMBOS = [(0, "pread", "lru"), (1, "pread", "lfru"), (2, "pread", "learned"),
          (1, "mmap", "lru"), (2, "mmap", "lfru"), (0, "mmap", "learned")]


def _greedy(loaded) -> tuple[np.ndarray, list[int]]:
    return greedy_logits(loaded, PROMPT, STEPS)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    model_type, overrides = FAMILIES[request.param]
    src = build_checkpoint(tmp_path_factory.mktemp("src"), model_type, **overrides)
    out = convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None)
    return out, _greedy(load_model(out))


@pytest.mark.parametrize("depth, io, policy", COMBOS)
def test_a_tenth_of_the_experts_gives_the_same_bytes(family, tmp_path, depth, io, policy):
    container, (want_logits, want_tokens) = family
    probe = load_model(container, offload=OffloadOptions(StoreSettings(capacity=1 << 30)))
    store = probe.store
    total = sum(r.length for r in store.recipes.values())
    top_k = max(getattr(layer.ffn, "top_k", 0) for layer in probe.spec.layers)
    slot = store.slot_bytes
    probe.close()
    capacity = max(total // 10 // slot, top_k) * slot
    history = tmp_path / "usage.npz"
    for run in range(2):                          # the second run starts with pins learned by the first
        loaded = load_model(container, offload=OffloadOptions(StoreSettings(capacity, io=io, policy=policy), depth, history))
        try:
            logits, tokens = _greedy(loaded)
            stats = loaded.store.stats()
        finally:
            loaded.close()
        assert tokens == want_tokens, (run, depth, io, policy)
        assert np.array_equal(logits, want_logits), (run, depth, io, policy)
        assert stats.hits["disk"] > 0             # it really streamed
        assert stats.occupancy["pinned"] + stats.occupancy["cached"] <= capacity


@pytest.mark.parametrize("held, depth, io", [(0, 0, "pread"), (1, 2, "pread"), (0, 1, "mmap")])
def test_a_dense_model_streaming_its_layers_gives_the_same_bytes(tmp_path_factory, held, depth, io):
    src = build_checkpoint(tmp_path_factory.mktemp("dense"), "llama", num_hidden_layers=4)
    out = convert(src, tmp_path_factory.mktemp("c") / "dense", ConvertSettings(bits=4), log=lambda m: None)
    want = _greedy(load_model(out))
    loaded = load_model(out, offload=OffloadOptions(StoreSettings(0, io=io), depth, None, resident_layers=held))
    try:
        got = _greedy(loaded)
    finally:
        loaded.close()
    assert got[1] == want[1] and np.array_equal(got[0], want[0])
