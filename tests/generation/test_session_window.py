"""A saved session of a sliding-window model (whose cache dropped rows behind the window) restores into a fresh
pool and continues with the same logits, bit for bit; saving again after the window moved on still does."""

from __future__ import annotations

import numpy as np

from engine.generation.sampling import SamplingParams
from engine.generation.session import KVSettings, SessionFile, SessionState
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from support.tiny_checkpoint import write_tiny

MISTRAL = {
    "architectures": ["MistralForCausalLM"], "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96, "sliding_window": 9,
    "max_position_embeddings": 1024,
}
PROMPT = [3, 17, 5, 90, 42, 8, 23, 61, 7, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


def _steps(model, cache: KVCache, token: int, n: int) -> tuple[list[np.ndarray], int]:
    """n greedy steps from `token`: each step's logits, and the token pending after them."""
    rows = []
    for _ in range(n):
        rows.append(model.forward([token], cache)[-1])
        token = int(rows[-1].argmax())
    return rows, token


def _state(cache: KVCache, pending: int) -> SessionState:
    return SessionState(tuple(cache.tokens) + (pending,), len(PROMPT), pending, SamplingParams(), None, {})


def test_a_windowed_session_restores_and_continues_exactly(tmp_path):
    model = load_model(write_tiny(tmp_path / "m", MISTRAL)).model
    cache = KVCache(model.spec, 200, pool=KVPool(model.spec, 64, block_size=4))
    token = int(model.forward(PROMPT, cache)[-1].argmax())
    _, token = _steps(model, cache, token, 20)
    assert cache.pool.dropped.any()
    settings = KVSettings.of(cache)
    session = SessionFile(tmp_path / "chat.session", "hash", settings)
    session.save(cache, _state(cache, token))
    _, token = _steps(model, cache, token, 10)                 # the window moves past blocks already saved
    session.save(cache, _state(cache, token))
    want, _ = _steps(model, cache, token, 8)

    restored, state = SessionFile(tmp_path / "chat.session", "hash", settings).load(
        KVPool(model.spec, 64, block_size=4))
    assert restored.length == cache.length - 8 and state.pending == token
    assert restored.pool.dropped.any()                        # rows behind the window dropped again
    got, _ = _steps(model, restored, token, 8)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
