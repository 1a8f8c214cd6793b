"""`colibri eval`'s scoring: windows, perplexity against a direct computation, KL and top-1."""

from __future__ import annotations

import numpy as np
import pytest

from app.bench.evaluate import evaluate, windows
from engine.kv import KVCache
from engine.loader import load_model
from support.reference import build_checkpoint


@pytest.mark.parametrize("n, ctx", [(10, 4), (10, 10), (100, 16), (3, 8), (17, 5)])
def test_windows_score_every_token_once_with_context(n, ctx):
    scored = []
    for start, end, first in windows(n, ctx):
        assert end - start <= ctx and start < first <= end
        assert first == 1 or first - start >= ctx // 2 or start == 0  # at least half a window of context
        scored += list(range(first, end))
    assert scored == list(range(1, n))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(build_checkpoint(tmp_path_factory.mktemp("eval"), "llama"))


def _direct_nll(model, ids):
    logits = model.forward(ids, KVCache(model.spec, len(ids)), all_logits=True).astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return -np.mean([logp[i, ids[i + 1]] for i in range(len(ids) - 1)])


def test_perplexity_matches_a_direct_computation(tiny):
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 160, 40)]
    result = evaluate(tiny.model, ids, ctx=64)
    assert result.tokens == 39
    assert result.nll == pytest.approx(_direct_nll(tiny.model, ids), rel=1e-6)


def test_against_itself_kl_is_zero_and_top1_is_one(tiny):
    ids = [int(t) for t in np.random.default_rng(1).integers(0, 160, 50)]
    result = evaluate(tiny.model, ids, ctx=16, reference=tiny.model)
    assert result.kl == pytest.approx(0.0, abs=1e-9) and result.top1 == 1.0
    assert result.ref_nll == pytest.approx(result.nll)


def test_against_another_model_kl_is_positive(tiny, tmp_path):
    other = load_model(build_checkpoint(tmp_path / "other", "llama", seed=7))
    ids = [int(t) for t in np.random.default_rng(2).integers(0, 160, 50)]
    result = evaluate(tiny.model, ids, ctx=32, reference=other.model)
    assert result.kl > 0.01 and 0 <= result.top1 < 1
