"""The fused decode step and the dense families: Mistral's windowed layers run fused with the same bits as the
blocks (while its cache drops rows behind the window); Gemma 2/3's and OLMo 2's layers are declined and decode
through the blocks. Each model goes through a 4-bit container first (the container round trip)."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from support.reference import build_checkpoint

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9]
STEPS = 12
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=5)

FUSED = {
    "mistral-window": ("mistral", dict(sliding_window=6, head_dim=24)),
    "mistral-no-window-tied": ("mistral", dict(sliding_window=None, tie_word_embeddings=True)),
}
BLOCKS_ONLY = {
    "gemma2-capped": ("gemma2", dict(GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=4.0)),
    "gemma3": ("gemma3_text", dict(GEMMA, sliding_window_pattern=2, num_hidden_layers=4)),
    "olmo2": ("olmo2", dict()),
}


def _model(tmp_path_factory, case: dict, name: str):
    model_type, overrides = case[name]
    src = build_checkpoint(tmp_path_factory.mktemp(name), model_type, **overrides)
    return load_model(convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4),
                              log=lambda m: None)).model


def _greedy(model, fused: bool) -> np.ndarray:
    """STEPS greedy steps' logits after PROMPT, in blocks of 4 positions (rows behind a window get dropped)."""
    model.context.fused_decode = fused
    cache = KVCache(model.spec, 64, pool=KVPool(model.spec, 32, block_size=4))
    logits = model.forward(PROMPT, cache)[-1]
    out = []
    for _ in range(STEPS):
        logits = model.forward([int(logits.argmax())], cache)[-1]
        out.append(logits)
    cache.release()
    return np.stack(out)


@pytest.fixture
def threads():
    before = numba.get_num_threads()
    yield numba.set_num_threads
    numba.set_num_threads(before)


@pytest.mark.parametrize("name", list(FUSED))
def test_mistral_fused_steps_equal_the_blocks(tmp_path_factory, threads, name):
    model = _model(tmp_path_factory, FUSED, name)
    want = _greedy(model, fused=False)
    assert model.context.fused is False                           # never built: the blocks ran every step
    for n in (1, 2):
        threads(n)
        got = _greedy(model, fused=True)
        assert model.context.fused not in (None, False)
        assert model.context.fused.kquant is None                 # the step variant without the K-quant kernels
        assert np.array_equal(got, want), n


@pytest.mark.parametrize("name", list(BLOCKS_ONLY))
def test_gemma_and_olmo2_decode_through_the_blocks(tmp_path_factory, name):
    model = _model(tmp_path_factory, BLOCKS_ONLY, name)
    want = _greedy(model, fused=False)
    got = _greedy(model, fused=True)
    assert model.context.fused is None                            # looked at once, and declined
    assert np.array_equal(got, want) and np.all(np.isfinite(got))
