"""token_logprobs against a plain numpy log-softmax: the chosen token's value and the top alternatives in order."""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import GenerationError
from engine.generation.sampling import token_logprobs


def _reference(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()


@pytest.mark.parametrize("vocab", [7, 5000, 152_000])
def test_values_and_top_alternatives_match_numpy(vocab):
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal(vocab) * 4).astype(np.float32)
    ref = _reference(logits)
    token = int(rng.integers(vocab))
    lp, top = token_logprobs(logits, token, 5)
    assert lp == pytest.approx(ref[token], abs=1e-9)
    order = np.argsort(-ref, kind="stable")[:5]
    assert [i for i, _ in top] == list(order)
    np.testing.assert_allclose([v for _, v in top], ref[order], atol=1e-9)


def test_ties_go_to_the_lowest_id_and_masked_tokens_have_minus_infinity():
    logits = np.array([1.0, 3.0, -np.inf, 3.0, 2.0], dtype=np.float32)
    lp, top = token_logprobs(logits, 2, 3)
    assert lp == -np.inf
    assert [i for i, _ in top] == [1, 3, 4]
    assert token_logprobs(logits, 1, 0)[1] == ()


def test_nan_logits_are_refused():
    with pytest.raises(GenerationError, match="NaN"):
        token_logprobs(np.array([0.0, np.nan], dtype=np.float32), 0, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from app.hub.convert import ConvertSettings, convert
    from engine.loader import load_model
    from support.families import FAMILIES
    from support.reference import build_checkpoint

    model_type, overrides = FAMILIES["mixtral"]
    src = build_checkpoint(tmp_path_factory.mktemp("mixtral"), model_type, **overrides)
    return load_model(convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None))


def test_every_path_reports_the_same_logprobs(tiny):
    # the scheduler (the server's path), plain decoding and speculative decoding (drafts verified in one pass)
    from engine.events import TokenEvent
    from engine.generation.generate import GenerationRequest, stream_generate
    from engine.generation.sampling import SamplingParams
    from engine.generation.scheduler import Scheduler
    from engine.generation.speculative import SpeculativeSettings
    from engine.kv import KVCache, KVPool

    prompt = (5, 17, 99, 3, 5, 17, 99, 3, 5, 17)
    request = GenerationRequest(prompt=prompt, max_tokens=12, sampling=SamplingParams(temperature=0.8, seed=4),
                                logprobs=3)

    def scores(events):
        return [(e.token_id, e.logprob, e.top_logprobs) for e in events if isinstance(e, TokenEvent)]

    plain = scores(stream_generate(tiny.model, None, request, cache=KVCache(tiny.spec, 64)))
    spec = GenerationRequest(**{**request.__dict__, "speculative": SpeculativeSettings(max_draft=3, adaptive=False)})
    drafted = scores(stream_generate(tiny.model, None, spec, cache=KVCache(tiny.spec, 64)))
    sched = Scheduler(tiny.model, KVPool(tiny.spec, 64, block_size=4), max_len=64)
    seq = sched.submit(request)
    sched.run()
    batched = scores(seq.drain())
    assert len(plain) == 12 and all(len(top) == 3 for _, _, top in plain)
    for got in (drafted, batched):
        assert [t for t, _, _ in got] == [t for t, _, _ in plain]
        np.testing.assert_allclose([lp for _, lp, _ in got], [lp for _, lp, _ in plain], atol=2e-4)
