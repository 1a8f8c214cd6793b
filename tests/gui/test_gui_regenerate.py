"""Regenerating any answer and drafting answers (pytest-qt, offscreen, the tiny chat model): regenerate on an
earlier answer branches and keeps the old one reachable; drafting by prompt lookup gives the same greedy answer as
plain decoding, token for token; the MTP choice is offered only to models that ship an MTP head."""

from __future__ import annotations

from engine.events import DoneEvent
from support.qt import *  # noqa: F403 - the GUI fixtures (no_leftovers is autouse)
from support.qt import LOAD_TIMEOUT_MS, ask, click_link


def test_regenerate_on_an_earlier_answer_branches_and_keeps_the_old_one(qtbot, window):
    chat = window.chat
    first = ask(qtbot, window, "First question")
    ask(qtbot, window, "Second question")
    before = chat.conversation
    assert [t.role for t in before.turns] == ["user", "assistant"] * 2
    with qtbot.waitSignal(chat.generatingChanged, check_params_cb=lambda busy: not busy, timeout=LOAD_TIMEOUT_MS):
        click_link(qtbot, chat.transcript, "#message-regenerate-1")     # the first answer, not the last
    after = chat.conversation
    assert after.id == before.id and [t.content for t in after.turns] == ["First question", first.text]  # greedy
    saved = {c.id: c for c in window.store.list()}
    branch = next(c for c in saved.values() if c.id != before.id)
    assert len(saved) == 2 and saved[before.id] == after
    assert branch.title == "First question (branch)" and branch.turns == before.turns      # nothing lost
    assert "Second question" not in chat.transcript.toPlainText()
    assert window.conversations.ids() == [before.id, branch.id]
    # the old answer is one click away, and regenerating there branches again
    window.conversations.selected.emit(branch.id)
    assert chat.conversation == branch and "Second question" in chat.transcript.toPlainText()
    # while an answer is being written, a regenerate link does nothing but say why
    chat.max_tokens.setValue(400)
    chat.input.setPlainText("Third")
    chat.send()
    assert chat.generating and not chat.regenerate_at(1) and "Wait for the answer" in chat.status.text()
    with qtbot.waitSignal(chat.generatingChanged, timeout=LOAD_TIMEOUT_MS):
        chat.stop()
    assert not chat.regenerate_at(0) and "not an answer" in chat.status.text()


def test_drafting_by_prompt_lookup_gives_the_same_greedy_answer(qtbot, window, monkeypatch):
    chat = window.chat
    assert chat.drafting.mode() is False and chat.drafting.isEnabled()
    mtp = chat.drafting.model().item(chat.drafting.findData("mtp"))
    assert not window.info.mtp and not mtp.isEnabled() and "no MTP head" in mtp.toolTip()
    chat.drafting.set_mode("mtp")                       # not offered: it stays off
    assert chat.drafting.mode() is False
    asked: list = []
    generate = window.bridge.service.generate
    monkeypatch.setattr(window.bridge.service, "generate", lambda **kw: asked.append(kw) or generate(**kw))
    # a question that repeats itself, so that the answer has something to look up
    question = "abc abc abc abc abc abc abc abc"
    plain = ask(qtbot, window, question, max_tokens=40)
    chat.new_conversation()
    chat.drafting.setCurrentIndex(chat.drafting.findData("lookup"))
    drafted = ask(qtbot, window, question, max_tokens=40)
    assert [kw["speculative"] for kw in asked] == [False, "lookup"]
    assert drafted.tokens == plain.tokens and drafted.text == plain.text and len(plain.tokens) == 40
    counts = window.bridge.service._model.scheduler.drafting     # the engine's counters of drafted answers
    assert counts.sequences == 1 and counts.drafted > 0
    assert isinstance(drafted, DoneEvent) and chat.conversation.turns[-1].content == plain.text


def test_colibri_gui_speculative_starts_with_prompt_lookup_chosen(qtbot, make_window, models):
    from dataclasses import replace

    window = make_window()
    window.load_options = replace(window.load_options, speculative=True)   # `colibri gui MODEL --speculative`
    with qtbot.waitSignal(window.bridge.modelLoaded, timeout=LOAD_TIMEOUT_MS):
        window.open_model(str(models[1]))
    assert window.chat.drafting.mode() == "lookup"
    window.chat.drafting.setCurrentIndex(0)                 # the user's choice holds for the next model
    with qtbot.waitSignal(window.bridge.modelLoaded, timeout=LOAD_TIMEOUT_MS):
        window.open_model(str(models[1]))
    assert window.chat.drafting.mode() is False


def test_a_model_with_an_mtp_head_is_offered_mtp_drafting(tmp_path):
    import json

    from app.service.model import has_mtp

    folder = tmp_path / "glm"
    folder.mkdir()
    config = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 8,
              "num_experts_per_tok": 2, "vocab_size": 160, "first_k_dense_replace": 1,
              "num_nextn_predict_layers": 1}
    (folder / "config.json").write_text(json.dumps(config))
    assert has_mtp(folder)
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    assert not has_mtp(folder)
    assert not has_mtp(tmp_path / "model.gguf") and not has_mtp(tmp_path / "missing")


def test_the_mtp_choice_follows_the_model(qtbot):
    from dataclasses import replace
    from pathlib import Path
    from types import MappingProxyType

    from app.service.local import EngineSettings, ModelInfo
    from ui.chat_options import DraftingChoice

    info = ModelInfo(Path("m"), "m", "glm4_moe", 2, 8, 2, True, 2048, "", None, MappingProxyType({}),
                     EngineSettings(None, 0, 2, 2048), 160, mtp=True)
    choice = DraftingChoice()
    qtbot.addWidget(choice)
    choice.set_model(info)
    choice.set_mode("mtp")
    assert choice.mode() == "mtp"
    choice.set_model(replace(info, mtp=False))          # the next model has none: drafting falls back to off
    assert choice.mode() is False
    choice.set_mode(True)                               # `--speculative` alone: prompt lookup
    assert choice.mode() == "lookup"
    choice.set_model(info, remote="http://server:8080")     # a server drafts as it was started
    assert not choice.isEnabled() and choice.mode() is False and "server:8080" in choice.toolTip()
