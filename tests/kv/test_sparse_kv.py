"""The KV cache with GLM-5's sparse-attention indexer keys: paging, prefix reuse, eviction and saved sessions
keep them as they keep the latents, so a query selects the same keys however its cache was filled."""

from __future__ import annotations

import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.generation.sampling import SamplingParams
from engine.generation.session import KVSettings, SessionFile, SessionState
from engine.kernels.rows import rope_rows
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from support.families import FAMILIES
from support.reference import build_checkpoint

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 140, 31, 77, 2, 120, 56, 11]


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    """A 4-bit container of the tiny GLM-5 (index_topk 4: the selection decides from the fifth token on):
    its kernels are bitwise row-invariant, so cached, shared and restored runs give a fresh run's logits."""
    model_type, overrides = FAMILIES["glm_moe_dsa"]
    src = build_checkpoint(tmp_path_factory.mktemp("glm5"), model_type, **overrides)
    return load_model(convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None))


def _decode(model, cache, prompt, steps=6) -> np.ndarray:
    rows = [model.forward(prompt, cache, all_logits=True)]
    for _ in range(steps):
        rows.append(model.forward([int(np.argmax(rows[-1][-1]))], cache))
    return np.concatenate(rows)


@pytest.mark.parametrize("block", [1, 4, 64])
def test_block_size_never_changes_the_logits(glm5, block):
    want = _decode(glm5.model, KVCache(glm5.spec, 64), PROMPT)
    pool = KVPool(glm5.spec, 200, block_size=block)
    pool.free.reverse()                      # hand out blocks in an order unlike positions
    assert all("ik" in layer for layer in pool.layers)
    assert np.array_equal(_decode(glm5.model, KVCache(glm5.spec, 64, pool=pool), PROMPT), want)


def test_prefix_reuse_shares_the_indexer_keys(glm5):
    pool = KVPool(glm5.spec, 32, block_size=4)
    glm5.model.forward(PROMPT, KVCache(glm5.spec, 64, pool=pool))
    question = PROMPT + [11, 12, 13]
    second = KVCache(glm5.spec, 64, pool=pool)
    held = second.adopt(question)
    assert held == 20
    reused = glm5.model.forward(question[held:], second, all_logits=True)
    fresh = glm5.model.forward(question, KVCache(glm5.spec, 64), all_logits=True)[held:]
    assert np.array_equal(reused, fresh)


@pytest.mark.parametrize("bits", [32, 8])
def test_a_saved_session_restores_the_indexer_keys(glm5, tmp_path, bits):
    pool = KVPool(glm5.spec, 64, block_size=4, bits=bits)
    cache = KVCache(glm5.spec, 64, pool=pool)
    glm5.model.forward(PROMPT, cache)
    want = glm5.model.forward([7, 8], cache, all_logits=True)
    cache.truncate(len(PROMPT))
    path = tmp_path / "glm5.session"
    state = SessionState(tuple(PROMPT), len(PROMPT), None, SamplingParams(), None, {})
    SessionFile(path, "glm5", KVSettings.of(cache)).save(cache, state)
    restored, _ = SessionFile(path, "glm5", KVSettings.of(cache)).load(KVPool(glm5.spec, 64, block_size=4, bits=bits))
    for mine, theirs in zip(restored.pool.layers, cache.pool.layers):
        assert np.array_equal(mine["ik"][restored.table], theirs["ik"][cache.table])
    assert np.array_equal(glm5.model.forward([7, 8], restored, all_logits=True), want)


def test_eviction_moves_the_indexer_keys_back_as_their_positions(glm5):
    """Sliding past the context drops the first block; the next block's indexer keys, rotated by RoPE at
    positions 4..7, are rotated back to 0..3 like the rotary keys beside them."""
    pool = KVPool(glm5.spec, 8, block_size=4)
    cache = KVCache(glm5.spec, 12, pool=pool, overflow="slide")
    glm5.model.forward(PROMPT[:12], cache)
    rope = glm5.spec.layers[0].attn.rope
    moved = pool.layers[0]["ik"][cache.table[1]].copy()                       # [4, Di] at positions 4..7
    glm5.model.forward(PROMPT[12:13], cache)                                  # 13 > 12: block 0 goes
    assert cache.length == 9 and cache.evicted == 4
    angles = np.arange(4, 8, dtype=np.float32)[:, None] * rope.inv_freq()[None, :]
    raw = rope_rows(moved[:, None, :], np.cos(-angles), np.sin(-angles), rope.dim, False)   # undo 4..7
    angles = np.arange(0, 4, dtype=np.float32)[:, None] * rope.inv_freq()[None, :]
    want = rope_rows(raw, np.cos(angles), np.sin(angles), rope.dim, False)[:, 0]            # redo at 0..3
    assert np.allclose(pool.layers[0]["ik"][cache.table[0]], want, atol=1e-5)
