"""`colibri chat --speculative`: each turn drafts through the scheduler and answers exactly what the plain chat
answers, turn after turn (the kept cache of the conversation holds what plain decoding leaves)."""

from __future__ import annotations

import threading

import pytest

from app.commands.chat import ChatSession
from app.hub.convert import ConvertSettings, convert
from engine.events import DoneEvent
from engine.generation.sampling import SamplingParams
from engine.generation.speculative import SpeculativeSettings
from engine.loader import load_model
from support.tiny_chat import tiny_moe

TURNS = ("one two three, one two three, one two three", "again: one two three, one two three")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    src = tiny_moe(tmp_path_factory.mktemp("moe"))
    model = load_model(convert(src, tmp_path_factory.mktemp("c") / "tiny", ConvertSettings(bits=4),
                               log=lambda m: None))
    yield model
    model.close()


def _chat(loaded, sampling, speculative) -> tuple[list[tuple[int, ...]], ChatSession]:
    session = ChatSession(loaded, sampling, max_tokens=32, ctx=512, system=None, speculative=speculative)
    answers = []
    for text in TURNS:
        done = list(session.answer(text, threading.Event()))[-1]
        assert isinstance(done, DoneEvent), done
        answers.append(done.tokens)
    return answers, session


@pytest.mark.parametrize("sampling", [SamplingParams(repetition_penalty=1.1),
                                      SamplingParams(temperature=0.8, seed=4)], ids=["greedy", "seeded"])
def test_a_speculative_chat_answers_as_the_plain_one(loaded, sampling):
    plain, plain_session = _chat(loaded, sampling, None)
    drafted, session = _chat(loaded, sampling, SpeculativeSettings(adaptive=False))
    assert drafted == plain
    assert session.messages == plain_session.messages
    assert session.cache.tokens == plain_session.cache.tokens
    assert session.drafting is not None and session.drafting.sequences == 2 and session.drafting.drafted > 0
