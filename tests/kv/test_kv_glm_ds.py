"""GLM-4.5's partial-RoPE attention and DeepSeek-V2's latent attention through the paged cache: any block
size, a reused prefix and a batch of sequences give exactly the logits of a fresh run alone."""

from __future__ import annotations

import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from support.families import FAMILIES
from support.reference import build_checkpoint

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 31, 77, 2, 45, 120, 6, 18]
OTHER = [120, 6, 18, 44, 2, 90, 71, 33, 8]


@pytest.fixture(scope="module", params=["glm4_moe", "deepseek_v2"])
def tiny(request, tmp_path_factory):
    model_type, overrides = FAMILIES[request.param]
    src = build_checkpoint(tmp_path_factory.mktemp(request.param), model_type, **overrides)
    return load_model(convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None))


def _decode(model, cache, prompt, steps=6) -> np.ndarray:
    rows = [model.forward(prompt, cache, all_logits=True)]
    for _ in range(steps):
        rows.append(model.forward([int(np.argmax(rows[-1][-1]))], cache))
    return np.concatenate(rows)


@pytest.mark.parametrize("block", [1, 4])
def test_block_size_never_changes_the_logits(tiny, block):
    want = _decode(tiny.model, KVCache(tiny.spec, 64), PROMPT)
    pool = KVPool(tiny.spec, 200, block_size=block)
    pool.free.reverse()                      # hand out blocks in an order unlike positions
    assert np.array_equal(_decode(tiny.model, KVCache(tiny.spec, 64, pool=pool), PROMPT), want)


def test_a_reused_prefix_gives_identical_logits(tiny):
    pool = KVPool(tiny.spec, 32, block_size=4)
    tiny.model.forward(PROMPT, KVCache(tiny.spec, 64, pool=pool))
    question = PROMPT + [11, 12, 13]
    second = KVCache(tiny.spec, 64, pool=pool)
    held = second.adopt(question)
    assert held == 20
    reused = tiny.model.forward(question[held:], second, all_logits=True)[-1]
    assert np.array_equal(reused, tiny.model.forward(question, KVCache(tiny.spec, 64), all_logits=True)[-1])


def test_a_batch_gives_each_sequence_its_logits_alone(tiny):
    alone = [tiny.model.forward(p, KVCache(tiny.spec, 64), all_logits=True) for p in (PROMPT, OTHER)]
    batch = tiny.model.forward_batch([(p, KVCache(tiny.spec, 64)) for p in (PROMPT, OTHER)], all_logits=True)
    assert all(np.array_equal(got, want) for got, want in zip(batch, alone))
