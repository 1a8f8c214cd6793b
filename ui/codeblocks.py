"""The pieces of an answer as the transcript draws them: Markdown cut into top-level segments, fenced code
blocks highlighted with Pygments, and Markdown inserted without losing its first block's format.

`split_segments` cuts an answer (possibly still streaming) at the boundaries that later text cannot move: a
blank line followed by an unindented line, and the fences of a code block. Every segment but the last is
finished, so the transcript draws it once and never parses it again; only the last is redrawn as text arrives.

Code blocks are drawn as plain blocks (no `nonBreakableLines`), so long lines wrap inside the block instead of
scrolling the whole transcript sideways; a header line names the language and carries a Copy link.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from pygments.lexer import Lexer
from pygments.lexers import TextLexer, get_lexer_by_name
from pygments.styles import get_style_by_name
from pygments.token import _TokenType
from pygments.util import ClassNotFound
from PySide6.QtCore import QCoreApplication
from PySide6.QtGui import (
    QColor,
    QFont,
    QFontDatabase,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextFormat,
)

from ui.theme import ChatColors

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)")
COPY = "copy-"      # a code block's Copy link target: "#copy-<block number>"
# GitHub's dialect without its permissive autolinks (a URL a model made up stays text) and without raw HTML;
# explicit [links](...) and <autolinks> remain
_GITHUB = QTextDocument.MarkdownFeature.MarkdownDialectGitHub.value
_PERMISSIVE_LINKS = 0x4 | 0x8 | 0x400    # md4c's permissive URL, e-mail and www. autolinks
MARKDOWN = QTextDocument.MarkdownFeature((_GITHUB & ~_PERMISSIVE_LINKS)
                                         | QTextDocument.MarkdownFeature.MarkdownNoHTML.value)


@dataclass(frozen=True)
class Segment:
    """A top-level piece of an answer: Markdown, or a fenced code block (its code without the fences)."""

    kind: Literal["markdown", "code"]
    source: str         # the answer's text this segment covers (fences, newlines and all)
    code: str = ""      # kind "code": the code
    language: str = ""  # kind "code": the fence's info word ("" if none)


def split_segments(text: str) -> list[Segment]:
    """text cut into segments; concatenating their sources gives text back."""
    segments: list[Segment] = []
    lines = text.splitlines(keepends=True)
    i, start = 0, 0         # line index, and the line where the Markdown segment being gathered began
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))

    def markdown_until(end: int) -> None:
        if end > start:
            segments.append(Segment("markdown", text[offsets[start]:offsets[end]]))

    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence and (lines[i].endswith("\n") or i + 1 < len(lines)):
            markdown_until(i)
            mark, language = fence.group(1), fence.group(2)
            j = i + 1
            while j < len(lines) and not _closes(lines[j], mark):
                j += 1
            body = "".join(lines[i + 1:j])
            end = min(j + 1, len(lines))
            segments.append(Segment("code", text[offsets[i]:offsets[end]], body.removesuffix("\n"), language))
            i = start = end
            continue
        if i > start and lines[i - 1].strip() == "" and lines[i].strip() and not lines[i][0].isspace():
            markdown_until(i)       # a blank line, then an unindented line: a new top-level block
            start = i
        i += 1
    markdown_until(len(lines))
    return segments


def _closes(line: str, mark: str) -> bool:
    """Whether line closes a fence opened with mark (the same character, at least as many, indent <= 3)."""
    body = line.strip()
    indent = len(line) - len(line.lstrip(" "))
    return indent <= 3 and len(body) >= len(mark) and set(body) == {mark[0]}


# --------------------------------------------------------------------------- Markdown


def insert_markdown(cursor: QTextCursor, text: str) -> None:
    """Insert Markdown at cursor (at the start of an empty block) keeping its first block's format.

    QTextCursor.insertMarkdown merges the first block into the block at the cursor, dropping its block format
    (a heading's level, a quote's indent) and, for a list, leaving an empty block before it: the format is
    taken from the same text parsed into a document of its own."""
    start = cursor.position()
    cursor.insertMarkdown(text, MARKDOWN)
    parsed = QTextDocument()
    parsed.setMarkdown(text, MARKDOWN)
    first = parsed.begin()
    doc = cursor.document()
    block = doc.findBlock(start)
    if not first.isValid() or not first.text():
        return
    if not block.text() and block.next().isValid() and block.next().text() == first.text():
        fix = QTextCursor(block)
        fix.movePosition(QTextCursor.MoveOperation.EndOfBlock)
        fix.movePosition(QTextCursor.MoveOperation.NextBlock, QTextCursor.MoveMode.KeepAnchor)
        list_of = block.next().textList()
        # a list of one item dies with its block below: keep its format to make it anew
        list_format = list_of.format() if list_of is not None and list_of.count() == 1 else None
        fix.removeSelectedText()        # the empty block goes; the list item's text joins it
        block = doc.findBlock(start)
        fmt = first.blockFormat()
        QTextCursor(block).setBlockFormat(fmt)
        if list_format is not None:
            QTextCursor(block).createList(list_format)
        elif list_of is not None and block.textList() is None:
            list_of.add(block)
        return
    QTextCursor(block).setBlockFormat(first.blockFormat())


def unwrap_code(doc: QTextDocument, start: int, colors: ChatColors) -> None:
    """Code blocks Markdown drew itself (indented ones) from `start` on: wrapping, fixed pitch, a background."""
    block = doc.findBlock(start)
    while block.isValid():
        fmt = block.blockFormat()
        if fmt.hasProperty(QTextFormat.Property.BlockCodeFence) or fmt.nonBreakableLines():
            fmt.setNonBreakableLines(False)
            fmt.setBackground(colors.code_background)
            fmt.setLeftMargin(8)
            cursor = QTextCursor(block)
            cursor.setBlockFormat(fmt)
            cursor.movePosition(QTextCursor.MoveOperation.EndOfBlock, QTextCursor.MoveMode.KeepAnchor)
            cursor.mergeCharFormat(mono_format())
        block = block.next()


# --------------------------------------------------------------------------- code blocks


def mono_format() -> QTextCharFormat:
    """The fixed-pitch font of code."""
    fmt = QTextCharFormat()
    fmt.setFontFixedPitch(True)
    fmt.setFontFamilies([QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont).family()])
    return fmt


@lru_cache(maxsize=64)
def _lexer(language: str) -> Lexer:
    try:
        return get_lexer_by_name(language.lower(), stripnl=False, ensurenl=False) if language else TextLexer(stripnl=False, ensurenl=False)
    except ClassNotFound:
        return TextLexer(stripnl=False, ensurenl=False)


def highlight(code: str, language: str, dark: bool) -> list[tuple[str, QTextCharFormat]]:
    """code as runs of (text, format) coloured by Pygments' lexer for language (plain text if unknown)."""
    style = get_style_by_name("monokai" if dark else "default")
    runs: list[tuple[str, QTextCharFormat]] = []
    formats: dict[_TokenType, QTextCharFormat] = {}
    for ttype, value in _lexer(language).get_tokens(code):
        fmt = formats.get(ttype)
        if fmt is None:
            fmt = formats[ttype] = mono_format()
            spec = style.style_for_token(ttype)
            if spec["color"]:
                fmt.setForeground(QColor("#" + spec["color"]))
            if spec["bold"]:
                fmt.setFontWeight(QFont.Weight.Bold)
            if spec["italic"]:
                fmt.setFontItalic(True)
        runs.append((value, fmt))
    return runs


def insert_code(cursor: QTextCursor, code: str, language: str, number: int, colors: ChatColors, dark: bool) -> None:
    """A code block at cursor (at the start of an empty block): a header with its language and a Copy link
    (`#copy-<number>`), then the highlighted code on its background, wrapping long lines."""
    header = QTextBlockFormat()
    header.setBackground(colors.code_background)
    header.setLeftMargin(8)
    header.setTopMargin(6)
    cursor.setBlockFormat(header)
    label = QTextCharFormat()
    label.setForeground(colors.muted)
    cursor.insertText((language or QCoreApplication.translate("Transcript", "code")) + "   ", label)
    link = QTextCharFormat(label)
    link.setAnchor(True)
    link.setAnchorHref(f"#{COPY}{number}")
    link.setFontUnderline(True)
    link.setToolTip(QCoreApplication.translate("Transcript", "copy the code to the clipboard"))
    cursor.insertText(QCoreApplication.translate("Transcript", "Copy"), link)
    body = QTextBlockFormat()
    body.setBackground(colors.code_background)
    body.setLeftMargin(8)
    body.setProperty(QTextFormat.Property.BlockCodeFence, "`")     # what it is (toMarkdown writes a fence)
    if language:
        body.setProperty(QTextFormat.Property.BlockCodeLanguage, language)
    cursor.insertBlock(body, mono_format())
    for value, fmt in highlight(code, language, dark):
        lines = value.split("\n")
        for k, piece in enumerate(lines):
            if k:
                cursor.insertBlock(body, mono_format())
            if piece:
                cursor.insertText(piece, fmt)
    end = QTextBlockFormat(body)
    end.setBottomMargin(6)
    cursor.setBlockFormat(end)
