"""`colibri chat` with a model that reasons in `<think>`: the reasoning is written apart (dimmed on a terminal)
and kept in the history for the template."""

from __future__ import annotations

import io
import threading

from app.commands.chat import AnswerWriter, ChatSession
from engine.events import DoneEvent, TokenEvent
from engine.generation.sampling import SamplingParams
from engine.loader import load_model
from support.reasoning_chat import ANSWER_TOKENS, MESSAGES, thinking_model


def test_writer_shows_reasoning_apart_and_dims_it_on_a_terminal():
    out = io.StringIO()
    writer = AnswerWriter(out, color=True)
    for text, reasoning in (("", "Two"), ("", " and two."), ("Four", ""), (".", "")):
        writer.write(text, reasoning)
    writer.end()
    assert out.getvalue() == "\x1b[2m[thinking]\nTwo and two.\x1b[0m\n[answer]\nFour."
    plain = io.StringIO()
    writer = AnswerWriter(plain, color=False)
    writer.write("no reasoning here")
    writer.end()
    assert plain.getvalue() == "no reasoning here"


def test_a_chat_turn_keeps_its_reasoning_apart(tmp_path):
    thinking = thinking_model(tmp_path / "thinking")
    loaded = load_model(thinking.folder)
    try:
        session = ChatSession(loaded, SamplingParams(), max_tokens=ANSWER_TOKENS, ctx=256, system=None)
        out = io.StringIO()
        writer = AnswerWriter(out, color=False)
        for event in session.answer(MESSAGES[0]["content"], threading.Event()):
            if isinstance(event, TokenEvent):
                writer.write(event.text, event.reasoning)
            elif isinstance(event, DoneEvent):
                writer.write(event.tail, event.reasoning_tail)
                done = event
        assert (done.reasoning, done.text) == (thinking.reasoning, thinking.content)
        assert thinking.before and thinking.after   # answer text on both sides of the reasoning
        assert out.getvalue() == f"{thinking.before}[thinking]\n{thinking.reasoning}\n[answer]\n{thinking.after}"
        assert session.messages[-1] == {"role": "assistant", "content": thinking.content,
                                        "reasoning_content": thinking.reasoning}
    finally:
        loaded.close()
