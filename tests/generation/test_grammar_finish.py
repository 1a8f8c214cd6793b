"""How a grammar-constrained answer finishes at its token budget: one whose grammar is done on the last allowed token
(only an end-of-sequence id could follow) is whole and finishes "stop", alone and batched; one cut before that is
"length"."""

from __future__ import annotations

import pytest

from app.hub.convert import ConvertSettings, convert
from engine.events import DoneEvent
from engine.generation.generate import GenerationRequest, stream_generate
from engine.generation.grammar import json_schema_grammar
from engine.generation.scheduler import Scheduler
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from support.tiny_chat import tiny_moe

CTX = 64
ONLY = {"enum": ["ab"]}     # one answer: '"ab"', four tokens of the tiny model's character tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    src = tiny_moe(tmp_path_factory.mktemp("moe"))
    return load_model(convert(src, tmp_path_factory.mktemp("c") / "tiny", ConvertSettings(bits=4), log=lambda m: None))


def _requests(budgets):
    return [GenerationRequest(prompt=(5, 6, 7), max_tokens=n, grammar=json_schema_grammar(ONLY)) for n in budgets]


def test_an_answer_done_on_its_last_token_finishes_stop_alone_and_batched(tiny):
    budgets = (3, 4, 5)
    alone = [list(stream_generate(tiny.model, tiny.tokenizer, r, stop_ids=tiny.stop_ids,
                                  cache=KVCache(tiny.spec, CTX)))[-1] for r in _requests(budgets)]
    sched = Scheduler(tiny.model, KVPool(tiny.spec, 3 * CTX, block_size=8), max_len=CTX, tokenizer=tiny.tokenizer,
                      stop_ids=tiny.stop_ids)
    seqs = [sched.submit(r) for r in _requests(budgets)]
    sched.run()
    batched = [[e for e in s.drain() if isinstance(e, DoneEvent)][-1] for s in seqs]
    for done in (alone, batched):
        assert all(isinstance(d, DoneEvent) for d in done), done
        assert [d.text for d in done] == ['"ab', '"ab"', '"ab"']
        # 3 tokens: cut inside the string; 4: done as the budget ends; 5: the end-of-sequence id was sampled
        assert [d.finish_reason for d in done] == ["length", "stop", "stop"]
        assert [len(d.tokens) for d in done] == [3, 4, 4]
        assert [d.stats.generated_tokens for d in done] == [3, 4, 5]
