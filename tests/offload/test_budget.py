"""The KV estimate of engine.offload.budget against what engine.kv really holds: a sliding-window layer counts
its window, the step being run and the block rounding, not the whole context."""

from __future__ import annotations

import numpy as np
import pytest

from engine.kv import KVCache, KVPool
from engine.loader import load_model
from engine.offload.budget import kv_bytes, window_positions
from support.tiny_checkpoint import write_tiny

VOCAB = 96
# Gemma 2's alternating local (window 12) and global layers; Mistral's window on every layer
GEMMA2 = {
    "architectures": ["Gemma2ForCausalLM"], "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
    "vocab_size": VOCAB, "sliding_window": 12, "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "max_position_embeddings": 1024,
}
MISTRAL = {
    "architectures": ["MistralForCausalLM"], "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB, "sliding_window": 9,
    "max_position_embeddings": 1024,
}


def _run(tmp_path, config: dict, prompt: int, chunk: int, block_size: int) -> tuple[object, KVPool, int, int]:
    """Run a prompt in chunks, then one token: (spec, pool, the most bytes the pool held after any step, the most
    blocks layer 0, a sliding-window layer, held)."""
    model = load_model(write_tiny(tmp_path / config["architectures"][0], config)).model
    pool = KVPool(model.spec, 256, block_size=block_size)
    cache = KVCache(model.spec, prompt + 1, pool=pool)
    tokens = np.random.default_rng(0).integers(0, VOCAB, prompt + 1).tolist()
    peak = local = 0
    steps = [tokens[s : min(s + chunk, prompt)] for s in range(0, prompt, chunk)] + [tokens[prompt:]]
    for step in steps:                        # rows are dropped when the next step is prepared: measure after each
        model.forward(step, cache)
        peak, local = max(peak, pool.nbytes), max(local, pool.held_blocks(0))
    assert pool.dropped.any()
    return model.spec, pool, peak, local


@pytest.mark.parametrize(("config", "chunk"), [(GEMMA2, 18), (GEMMA2, 64), (MISTRAL, 16), (MISTRAL, 7)])
def test_kv_bytes_bounds_what_a_long_prompt_holds(config, chunk, tmp_path):
    bs, ctx = 4, 300                          # whole blocks, as kv_bytes counts a full layer's positions
    spec, pool, peak, local = _run(tmp_path, config, ctx - 1, chunk, bs)
    estimate = kv_bytes(spec, ctx, block_size=bs, chunk=chunk)
    assert peak <= estimate
    window = window_positions(config["sliding_window"], ctx, bs, chunk)
    assert local * bs <= window <= (local + 1) * bs         # the window layer's own peak, a block over at most
    if all(layer.attn.sliding_window for layer in spec.layers):
        assert estimate - peak <= pool.group_bytes[0]
    assert estimate < kv_bytes(spec, ctx, block_size=bs, chunk=ctx)     # a step as long as the context holds it all


def test_the_worst_alignment_is_reached(tmp_path):
    # a step of 18 starting at 18 reaches back to 7, the last position of a block: window + chunk - 1 + 3
    spec, pool, peak, local = _run(tmp_path, MISTRAL | {"sliding_window": 12}, 299, 18, 4)
    assert local * 4 == window_positions(12, 300, 4, 18) == 32
    assert peak == kv_bytes(spec, 300, block_size=4, chunk=18)


def test_window_positions_never_exceed_the_context():
    assert window_positions(12, 10, 4, 256) == 10
    assert window_positions(4096, 100_000, 32, 256) == 32 * -(-(4096 + 256 + 30) // 32)
    assert window_positions(12, 10_000, 4, 1) == 16       # decode: the window and the block it starts in
