"""The Simplified Chinese UI (ui/i18n/colibri_zh_CN.ts, ui.language): every string of ui/ is in the .ts and
translated, with the placeholders of its source; the committed .qm is the .ts compiled; with the translator
installed, the main window, its dialogs and the inspector show no English text; the language chosen in the settings
is kept, and System follows the locale."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.qt import *  # noqa: F403 - the GUI fixtures (no_leftovers is autouse)

REPO = Path(__file__).resolve().parents[2]
TS = REPO / "ui" / "i18n" / "colibri_zh_CN.ts"
QM = TS.with_suffix(".qm")
TOOLS = Path(sys.executable).parent      # pyside6-lupdate and pyside6-lrelease come with PySide6 in the venv
PLACEHOLDER = re.compile(r"\{[^{}]*\}|%n|%L?\d+")
# Latin words a Chinese UI still shows: names, key caps, units and file kinds (besides links, which name projects and
# licences, paths, flags and `commands`)
KEPT = {"colibri", "gguf", "hugging", "face", "top", "mtp", "moe", "kv", "rss", "tok", "ttft", "io", "enter", "shift",
        "ctrl", "esc", "escape", "return", "markdown", "json", "belady", "opengl", "vispy", "pyside", "qt", "english",
        "kb", "mb", "gb", "ms", "smollm", "python", "sql"}


# what is no text to translate: links (projects and licences), tags, URLs, paths, --flags, `commands`, numbers, files
NOT_WORDS = re.compile(r"<a\b.*?</a>|<[^>]*>|https?://\S+|(?<![\w.])[~/.]?/[\w./-]+|--[\w-]+|`[^`]*`|\w+\.\w+")


@dataclass(frozen=True)
class Message:
    context: str
    source: str
    translation: str
    unfinished: bool


def messages() -> list[Message]:
    """The messages of the .ts."""
    found = []
    for context in ET.parse(TS).getroot().iter("context"):
        for m in context.iter("message"):
            t = m.find("translation")
            forms = [f.text or "" for f in t.iter("numerusform")] if m.get("numerus") == "yes" else [t.text or ""]
            found += [Message(context.findtext("name"), m.findtext("source"), form, t.get("type") is not None)
                      for form in forms]
    return found


def _tool(name: str) -> Path:
    tool = TOOLS / name
    if not tool.is_file():
        pytest.skip(f"{name} is not installed beside {sys.executable} (it comes with PySide6-Essentials)")
    return tool


@pytest.fixture
def chinese(qapp):
    """The Simplified Chinese translators installed for the test (English again afterwards)."""
    from ui.language import install_translation

    assert install_translation(qapp, "zh_CN") == "zh_CN"
    yield
    install_translation(qapp, "en")


def test_every_message_is_translated():
    found = messages()
    assert len(found) > 400
    left = [(m.context, m.source) for m in found if m.unfinished or not m.translation.strip()]
    assert not left, f"{len(left)} messages are not translated (`make translations`, then fill them in): {left}"


def test_translations_keep_the_placeholders_of_their_source():
    wrong = [(m.context, m.source, m.translation) for m in messages()
             if sorted(PLACEHOLDER.findall(m.source)) != sorted(PLACEHOLDER.findall(m.translation))]
    assert not wrong


def test_the_ts_holds_every_string_of_the_code(tmp_path):
    """Run `make translations` after changing a string: otherwise the new one shows in English."""
    fresh = tmp_path / "fresh.ts"
    sources = sorted(str(p) for p in (REPO / "ui").rglob("*.py"))
    subprocess.run([str(_tool("pyside6-lupdate")), "-silent", "-no-obsolete", *sources, "-ts", str(fresh)],
                   check=True, capture_output=True)
    kept = {(m.context, m.source) for m in messages()}
    made = {(c.findtext("name"), m.findtext("source")) for c in ET.parse(fresh).getroot().iter("context")
            for m in c.iter("message")}
    assert made - kept == set(), "strings of ui/ missing from the .ts"
    assert kept - made == set(), "strings of the .ts no longer in ui/"


def test_the_committed_qm_is_the_ts_compiled(tmp_path):
    compiled = tmp_path / "fresh.qm"
    subprocess.run([str(_tool("pyside6-lrelease")), "-silent", "-nounfinished", str(TS), "-qm", str(compiled)],
                   check=True, capture_output=True)
    assert compiled.read_bytes() == QM.read_bytes(), "ui/i18n/colibri_zh_CN.qm is stale: run `make translations`"


def test_the_qm_translates_every_message(qapp):
    from PySide6.QtCore import QTranslator

    translator = QTranslator()
    assert translator.load(str(QM))
    wrong = [(m.context, m.source) for m in messages()
             if translator.translate(m.context, m.source) != m.translation]
    assert not wrong


# --- the window in Chinese ---------------------------------------------------------------------------------------


def _texts(root) -> list[tuple[str, str]]:
    """(where, text) of what root and its children show: texts, titles, tooltips, placeholders, items, actions."""
    from PySide6.QtWidgets import QComboBox, QLabel, QProgressBar, QTableWidget, QTabWidget, QWidget

    found = []
    for w in [root, *root.findChildren(QWidget)]:
        if isinstance(w, QProgressBar):     # its text is the engine's progress message
            continue
        where = f"{type(w).__name__} {w.objectName()}".strip()
        for getter in ("text", "toolTip", "placeholderText", "windowTitle", "title", "statusTip", "specialValueText",
                       "suffix", "labelText"):
            read = getattr(w, getter, None)
            if callable(read) and not (isinstance(w, QLabel) and w.text() == "" and getter == "text"):
                try:
                    value = read()
                except TypeError:       # a getter of another signature (QTableWidget.title is none, e.g.)
                    continue
                if isinstance(value, str) and value:
                    found.append((f"{where}.{getter}", value))
        if isinstance(w, QTabWidget):
            found += [(f"{where} tab", w.tabText(i)) for i in range(w.count())]
        if isinstance(w, QComboBox):
            found += [(f"{where} item", w.itemText(i)) for i in range(w.count())]
        if isinstance(w, QTableWidget):
            found += [(f"{where} header", w.horizontalHeaderItem(i).text()) for i in range(w.columnCount())
                      if w.horizontalHeaderItem(i) is not None]
        for action in w.actions():
            found += [(f"{where} action", action.text()), (f"{where} action tip", action.toolTip())]
            if action.menu() is not None:
                found += _texts(action.menu())
    return found


def _plot_texts(inspector) -> list[tuple[str, str]]:
    """The axis titles and legend entries of the inspector's plots (drawn items, not widgets)."""
    items = [("overview", inspector.overview.memory_plot.getPlotItem()),
             ("overview", inspector.overview.disk_plot.getPlotItem()),
             ("time", inspector.time.plot.getPlotItem()), ("cache", inspector.cache.plot.getPlotItem()),
             ("brain", inspector.brain.plot)]
    found = [(f"{name} axis", item.getAxis(side).labelText) for name, item in items for side in ("left", "bottom")
             if item.getAxis(side).labelText]
    found += [("overview legend", label.text) for _, label in inspector.overview.legend.items]
    return found + [("budget bar", inspector.overview.budget_bar.format())]


def _english(texts: list[tuple[str, str]]) -> tuple[list, list]:
    """(texts that are a source string of the .ts as they are, texts with English words besides KEPT ones)."""
    changed = [m.source for m in messages() if m.translation != m.source]     # "Top-p" stays "Top-p"
    sources = {*changed, *(s.replace("&", "") for s in changed)}
    untranslated = [(where, text) for where, text in texts if text in sources]
    english = []
    for where, text in texts:
        plain = re.sub(NOT_WORDS, " ", text)
        words = {w.lower() for w in re.findall(r"[A-Za-z]{2,}", plain)} - KEPT
        if words:
            english.append((where, text, sorted(words)))
    return untranslated, english


def test_the_window_its_dialogs_and_the_inspector_show_chinese(qtbot, chinese, make_window):
    from PySide6.QtWidgets import QApplication

    from ui.transcript import stats_line

    window = make_window()
    chat = window.chat
    chat.transcript.add_user("?", 0)                         # a question's header and links
    chat.transcript.begin_answer(1)
    chat.transcript.end_answer("!", stats_line({"ttft_s": 0.2, "tok_s": 30.0, "tokens": 5,
                                                 "finish_reason": "length"}))
    dialogs = [window.show_settings(), window.show_shortcuts(), window.show_library(), window.show_first_run(),
               window.models.show_convert(), window._about()]
    texts = _texts(window) + [t for dlg in dialogs for t in _texts(dlg)]
    for i in range(window.inspector.tabs.count()):          # each tab's widgets as shown
        window.inspector.tabs.setCurrentIndex(i)
        QApplication.processEvents()
        texts += _texts(window.inspector)
    texts += _plot_texts(window.inspector)
    texts.append(("transcript", chat.transcript.toPlainText()))
    untranslated, english = _english(texts)
    assert not untranslated
    assert not english, "\n".join(map(repr, english))
    # what only shows this way: the theme menu, Qt's own buttons, the shortcuts' rows, the stats line
    assert [a.text() for a in window.theme_actions.values()] == ["跟随系统", "浅色", "深色"]
    assert {"确定", "取消"} <= {t for where, t in _texts(dialogs[0]) if "QPushButton" in where}
    assert {("发送", "Ctrl+回车"), ("发送问题", "回车")} <= set(dialogs[1].rows())    # key names as Qt's own
    shown = chat.transcript.toPlainText()
    assert "你" in shown and "5 个词元 · 已达最大词元数" in shown
    for dlg in dialogs:
        dlg.close()


def test_a_loaded_model_is_described_in_chinese(qtbot, chinese, make_window, models):
    window = make_window(models[1])
    chat, controls = window.chat, window.controls
    assert chat.status.text().startswith("就绪：")
    assert window.model_label.text().endswith("专家从磁盘流式读取")
    assert controls.context.value_label.text().endswith("个词元")
    texts = _texts(window) + _plot_texts(window.inspector)
    texts = [(where, t) for where, t in texts if window.info.name not in t and "tiny" not in t.lower()]
    untranslated, english = _english(texts)
    assert not untranslated
    assert not english, "\n".join(map(repr, english))


# --- the choice of language ----------------------------------------------------------------------------------------


def test_the_language_chosen_in_the_settings_is_kept(qtbot, make_window, tmp_path):
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QDialogButtonBox

    from ui.language import LANGUAGE_KEY, chosen_language

    ini = tmp_path / "settings.ini"
    window = make_window(settings_file=ini)
    dlg = window.show_settings()
    assert dlg.language.currentData() == "system" and dlg.restart_note.isHidden()
    assert [dlg.language.itemText(i) for i in range(dlg.language.count())] == ["System", "English", "简体中文"]
    dlg.language.setCurrentIndex(dlg.language.findData("zh_CN"))
    assert not dlg.restart_note.isHidden()                  # it takes effect at the next start, and says so
    dlg.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Ok).click()
    assert QSettings(str(ini), QSettings.Format.IniFormat).value(LANGUAGE_KEY) == "zh_CN"
    window.close()
    again = make_window(settings_file=ini)                    # the next run reads it back
    assert chosen_language(again.settings) == "zh_CN"
    assert chosen_language(again.settings, "en") == "en"      # `colibri gui --lang en` wins for a run
    kept = again.show_settings()
    assert kept.language.currentData() == "zh_CN"
    kept.reject()


@pytest.mark.parametrize("locale, language", [("zh_CN", "zh_CN"), ("zh_SG", "zh_CN"), ("zh_TW", "en"),
                                              ("en_US", "en"), ("de_DE", "en"), ("C", "en")])
def test_system_follows_the_locale(locale, language):
    from PySide6.QtCore import QLocale

    from ui.language import system_language

    assert system_language(QLocale(locale)) == language
