"""Saved conversations: round trip, atomic writes, order, unreadable files kept and skipped; rename, search,
branch (an edited question, a regenerated answer) and export."""

from __future__ import annotations

import json
import logging
import os

import pytest

from app.conversations import Conversation, ConversationStore, Sampling, Turn, conversations_dir, export


def _chat(question: str = "What is a hummingbird?") -> Conversation:
    return Conversation.new("Be brief.", Sampling(temperature=0.3, max_tokens=64)).with_turn(
        Turn("user", question)).with_turn(Turn("assistant", "A small bird.", {"tokens": 4, "tok_s": 12.5}))


def test_a_conversation_survives_a_round_trip(tmp_path):
    store = ConversationStore(tmp_path)
    conv = _chat()
    path = store.save(conv)
    assert path == tmp_path / f"{conv.id}.json" and conv.title == "What is a hummingbird?"
    again = ConversationStore(tmp_path).load(conv.id)           # a new store: as after a restart
    assert again == conv
    assert again.messages() == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "What is a hummingbird?"},
                                {"role": "assistant", "content": "A small bird."}]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_the_list_is_latest_first_and_delete_removes(tmp_path):
    store = ConversationStore(tmp_path)
    old, new = _chat("first"), _chat("second")
    new = Conversation(**{**new.__dict__, "updated": old.updated + 10})
    store.save(old)
    store.save(new)
    assert [c.title for c in store.list()] == ["second", "first"]
    store.delete(old.id)
    store.delete(old.id)                                        # twice is no error
    assert [c.id for c in store.list()] == [new.id]


def test_regenerate_drops_the_last_answer_only():
    conv = _chat()
    assert [t.role for t in conv.without_last_answer().turns] == ["user"]
    with pytest.raises(ValueError):
        conv.with_turn(Turn("system", "no"))


def test_an_unreadable_file_is_skipped_with_a_warning_and_never_overwritten(tmp_path, caplog):
    store = ConversationStore(tmp_path)
    good = _chat()
    store.save(good)
    broken = tmp_path / "0123abcd.json"
    broken.write_text('{"format": "colibri-conversation", "version": 1, "id": "0123abcd", "turns": [')
    foreign = tmp_path / "notes.json"
    foreign.write_text(json.dumps({"hello": "world"}))
    with caplog.at_level(logging.WARNING):
        assert [c.id for c in store.list()] == [good.id]
    assert "0123abcd.json" in caplog.text and "notes.json" in caplog.text
    assert set(store.skipped) == {broken, foreign}
    victim = Conversation(**{**_chat().__dict__, "id": "0123abcd"})
    with pytest.raises(ValueError, match="not overwritten"):
        store.save(victim)
    assert broken.read_text().endswith('"turns": [')              # left exactly as it was
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        store.list()
    assert caplog.text == ""                                     # warned once, not at every refresh


def test_ids_cannot_escape_the_folder(tmp_path):
    with pytest.raises(ValueError):
        ConversationStore(tmp_path).path("../etc/passwd")


def test_the_default_folder_is_in_the_user_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    if os.name != "posix" or not str(conversations_dir()).startswith(str(tmp_path)):
        pytest.skip("platformdirs does not follow XDG_DATA_HOME here")
    assert conversations_dir() == tmp_path / "colibri" / "conversations" and conversations_dir().is_dir()


def test_rename_collapses_spaces_and_refuses_an_empty_title():
    conv = _chat()
    assert conv.renamed("  Birds \n of  the Andes ").title == "Birds of the Andes"
    with pytest.raises(ValueError, match="cannot be empty"):
        conv.renamed(" \t")


def test_search_matches_every_word_in_the_title_or_the_text():
    conv = _chat().renamed("Andes trip")
    assert conv.matches("") and conv.matches("andes") and conv.matches("SMALL bird")
    assert conv.matches("trip small")                   # one word in the title, one in an answer
    assert not conv.matches("small penguin")


def test_an_edited_question_branches_and_keeps_the_old_continuation():
    conv = _chat("first").with_turn(Turn("user", "second")).with_turn(Turn("assistant", "two"))
    conv = conv.renamed("Counting")
    cut, old = conv.branched(2, "second, edited")
    assert cut.id == conv.id and cut.title == "Counting"
    assert [t.content for t in cut.turns] == ["first", "A small bird.", "second, edited"]
    assert old.id != conv.id and old.title == "Counting (branch)" and old.turns == conv.turns
    # editing the first question of an untitled chat names the chat after the new question
    first, _ = _chat("first").branched(0, "zeroth")
    assert first.title == "zeroth" and [t.content for t in first.turns] == ["zeroth"]
    with pytest.raises(ValueError, match="not a question"):
        conv.branched(1, "an answer is not edited")
    with pytest.raises(ValueError, match="empty"):
        conv.branched(0, "  ")


def test_a_regenerated_answer_branches_and_keeps_the_old_answer():
    conv = _chat("first").with_turn(Turn("user", "second")).with_turn(Turn("assistant", "two"))
    cut, old = conv.regenerated(1)              # the first answer, not the last
    assert cut.id == conv.id and cut.title == conv.title and cut.turns == conv.turns[:1]
    assert old.id != conv.id and old.title == f"{conv.title} (branch)" and old.turns == conv.turns
    last, _ = conv.regenerated(3)
    assert last.turns == conv.turns[:3] and last.turns[-1].content == "second"
    for index in (0, 2, 4, -1):                 # questions, and turns that are not there
        with pytest.raises(ValueError, match="not an answer"):
            conv.regenerated(index)
    lone = Conversation.new().with_turn(Turn("assistant", "hello")).with_turn(Turn("assistant", "again"))
    with pytest.raises(ValueError, match="follows no question"):
        lone.regenerated(1)


def test_the_context_used_is_the_last_answers_count():
    conv = _chat()
    assert conv.context_tokens() is None                # its stats predate the count
    counted = conv.with_turn(Turn("user", "more?")).with_turn(Turn("assistant", "No.", {"context_tokens": 57}))
    assert counted.context_tokens() == 57
    assert counted.with_turn(Turn("user", "why?")).context_tokens() is None   # a question not yet answered


def test_export_writes_markdown_or_json_atomically(tmp_path):
    conv = Conversation.new("Be brief.").with_turn(Turn("user", "Show code")).with_turn(
        Turn("assistant", "```python\nprint(1)\n```", {"tokens": 9, "model": "tiny"}, "They want code."))
    md = export(conv, tmp_path / "chat.md").read_text(encoding="utf-8")
    assert md.startswith("# Show code\n") and "> Be brief." in md
    assert md.index("## You") < md.index("Show code\n\n## Assistant") < md.index("They want code.")
    assert "```python\nprint(1)\n```" in md and "*tiny, 9 tokens*" in md
    again = Conversation.from_json(json.loads(export(conv, tmp_path / "chat.json").read_text(encoding="utf-8")))
    assert again == conv
    with pytest.raises(ValueError, match=r"ending in \.md, \.markdown, \.json"):
        export(conv, tmp_path / "chat.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.json", "chat.md"]    # no temporary left
