"""The tenet on a Kimi K2-shaped DeepSeek-V3 (384 experts in one group, K2's YaRN): a budget holding a tenth
of the expert bytes gives the bytes of the resident model."""

from __future__ import annotations

import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.loader import OffloadOptions, load_model
from engine.offload.store import StoreSettings
from support.families import MLA
from support.offload import greedy_logits
from support.reference import build_checkpoint

PROMPT = [3, 17, 5, 99, 42, 8, 23, 61, 7, 150, 12, 33]
K2_YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 16, "beta_fast": 1.0,
           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
K2 = dict(MLA, q_lora_rank=32, n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
          routed_scaling_factor=2.827, norm_topk_prob=True, rope_scaling=K2_YARN, max_position_embeddings=512,
          n_routed_experts=384, num_experts_per_tok=8)


@pytest.fixture(scope="module")
def k2(tmp_path_factory):
    src = build_checkpoint(tmp_path_factory.mktemp("src"), "deepseek_v3", **K2)
    out = convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None)
    return out, greedy_logits(load_model(out), PROMPT, 8)


@pytest.mark.slow
@pytest.mark.parametrize("depth, io", [(0, "pread"), (2, "pread"), (1, "mmap")])
def test_384_experts_streamed_give_the_resident_bytes(k2, depth, io):
    out, (want_logits, want_tokens) = k2
    probe = load_model(out, offload=OffloadOptions(StoreSettings(capacity=1 << 30)))
    total, slot = sum(r.length for r in probe.store.recipes.values()), probe.store.slot_bytes
    probe.close()
    capacity = max(total // 10 // slot, 8) * slot
    loaded = load_model(out, offload=OffloadOptions(StoreSettings(capacity, io=io), depth, None))
    try:
        logits, tokens = greedy_logits(loaded, PROMPT, 8)
        stats = loaded.store.stats()
    finally:
        loaded.close()
    assert tokens == want_tokens and np.array_equal(logits, want_logits)
    assert stats.hits["disk"] > 0                 # it really streamed
