"""Calibration text: the answers decoded together are the answers decoded one by one."""

from __future__ import annotations

import numpy as np
import pytest

from app.hub import calibrate
from app.hub.calibrate import REPETITION_PENALTY, answer_greedily
from engine.generation.generate import GenerationRequest, stream_generate
from engine.generation.sampling import SamplingParams
from engine.kv import KVCache
from engine.loader import open_checkpoint
from engine.models.transformer import Transformer
from support.reference import build_checkpoint

ANSWER = 10


def _solo(model, prompt, stop_ids) -> list[int]:
    request = GenerationRequest(prompt=tuple(prompt), max_tokens=ANSWER,
                                sampling=SamplingParams(repetition_penalty=REPETITION_PENALTY))
    cache = KVCache(model.spec, len(prompt) + ANSWER + 1)
    return list(list(stream_generate(model, None, request, stop_ids=stop_ids, cache=cache))[-1].tokens)


@pytest.mark.parametrize("chunk,rows", [(256, 2048), (20, 24)])   # one prefill pass; several, and one prompt alone
def test_answers_decoded_together_equal_one_by_one(tmp_path, monkeypatch, chunk, rows):
    monkeypatch.setattr(calibrate, "PREFILL_CHUNK", chunk)
    monkeypatch.setattr(calibrate, "PREFILL_ROWS", rows)
    ckpt = open_checkpoint(build_checkpoint(tmp_path, "llama", vocab_size=96, num_hidden_layers=2))
    model = Transformer(ckpt.spec, ckpt.source)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 96, n).tolist() for n in (5, 17, 9, 30)]
    free = [_solo(model, p, frozenset()) for p in prompts]
    stop = frozenset({free[1][3]})             # one answer ends early at a stop token (left out of the answer)
    expected = [_solo(model, p, stop) for p in prompts]
    assert len(expected[1]) <= 3 and any(len(e) == ANSWER for e in expected)
    assert answer_greedily(model, prompts, stop, max_tokens=ANSWER) == expected
