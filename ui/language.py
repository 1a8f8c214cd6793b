"""The language of the UI: English as written in the code, or Simplified Chinese (ui/i18n/colibri_zh_CN.qm).

The choice is "system", "en" or "zh_CN", kept in QSettings (`LANGUAGE_KEY`, the Settings dialog); `colibri gui
--lang` overrides it for one run. "system" follows the UI languages of QLocale.system() (on Linux LANGUAGE, then
LC_ALL, LC_MESSAGES, LANG): Simplified Chinese when the first of them that is English or Chinese is Chinese in the
simplified script. Translators are installed before the first widget is built, so a new choice takes effect at the
next start. Qt's own texts (OK, Cancel, the file dialogs) come from the qtbase translations that PySide6 ships.

The .ts source is ui/i18n/colibri_zh_CN.ts; `make translations` extracts the strings again (pyside6-lupdate) and
compiles the .qm (pyside6-lrelease), which is committed beside it.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, QLibraryInfo, QLocale, QSettings, QTranslator

LANGUAGE_KEY = "view/language"
LANGUAGES = ("system", "en", "zh_CN")   # the Settings dialog's choices, in its order
I18N = Path(__file__).resolve().parent / "i18n"
CATALOGUE = "colibri"                   # ui/i18n/colibri_<language>.qm
# a language is named in its own words, whatever the UI's; "system" is translated
_OWN_NAMES = {"system": QT_TRANSLATE_NOOP("Language", "System"), "en": "English", "zh_CN": "简体中文"}

_installed: list[QTranslator] = []      # the translators installed now (Qt does not own them: keep them alive)


def language_name(choice: str) -> str:
    """The name of a language choice as the Settings dialog lists it."""
    if choice == "system":
        return QCoreApplication.translate("Language", _OWN_NAMES["system"])
    return _OWN_NAMES[choice]


def chosen_language(settings: QSettings | None, override: str | None = None) -> str:
    """The language choice in force: override (`--lang`), else the one saved, else "system"."""
    choice = override or (str(settings.value(LANGUAGE_KEY, "system")) if settings is not None else "system")
    return choice if choice in LANGUAGES else "system"


def system_language(locale: QLocale | None = None) -> str:
    """"zh_CN" or "en": what the system's UI languages (or those of locale) ask for, of the two Colibri has."""
    for name in (locale or QLocale.system()).uiLanguages():
        lang = QLocale(name)
        if lang.language() == QLocale.Language.English:
            return "en"
        if lang.language() == QLocale.Language.Chinese:
            return "en" if lang.script() == QLocale.Script.TraditionalHanScript else "zh_CN"
    return "en"


def ui_language(choice: str) -> str:
    """"en" or "zh_CN" for a choice ("system" asks the system)."""
    return system_language() if choice == "system" else choice


def catalogue_path(language: str) -> Path:
    """The compiled translations of a language (none for English, the source language)."""
    return I18N / f"{CATALOGUE}_{language}.qm"


def install_translation(app: QCoreApplication, choice: str) -> str:
    """Install the translators of a language choice in app (replacing those installed before); the language shown,
    "en" or "zh_CN" ("en" too when the catalogue is missing, which only a broken install causes)."""
    for old in _installed:
        app.removeTranslator(old)
    _installed.clear()
    language = ui_language(choice)
    if language == "en":
        return language
    ours = QTranslator()
    if not ours.load(str(catalogue_path(language))):
        return "en"
    qt = QTranslator()          # Qt's own texts: standard buttons, file dialogs, key names
    if qt.load(f"qtbase_{language}", QLibraryInfo.path(QLibraryInfo.LibraryPath.TranslationsPath)):
        app.installTranslator(qt)
        _installed.append(qt)
    app.installTranslator(ours)
    _installed.append(ours)
    return language
