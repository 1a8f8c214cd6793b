"""Saved conversations: one JSON file each in the user's data folder, written atomically.

A conversation is a frozen value (its turns, system prompt, sampling settings, and the stats
of each answer); the store lists, saves and deletes them. A file that cannot be read is left
where it is, reported once as a warning and skipped: never overwritten, never deleted.
A conversation can be renamed, searched (`matches`), branched at an edited question or a regenerated answer (the
old continuation becomes a conversation of its own) and exported to Markdown or JSON (`export`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import platformdirs

from engine.atomic import atomic_file

log = logging.getLogger(__name__)

FORMAT = "colibri-conversation"
VERSION = 1
ROLES = ("user", "assistant")
TITLE_CHARS = 60


def conversations_dir() -> Path:
    """`<user data dir>/colibri/conversations` (honours XDG_DATA_HOME on Linux); created on demand."""
    path = Path(platformdirs.user_data_dir("colibri", appauthor=False)) / "conversations"
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class Turn:
    """One message; an answer also carries how it was made."""

    role: str                                   # "user" | "assistant"
    content: str
    stats: Mapping[str, Any] | None = None      # answers: ttft_s, tok_s, tokens, finish_reason, model,
                                                # context_tokens (prompt + answer, as the engine counted them)
    reasoning: str = ""                         # answers: the model's reasoning, apart from the answer

    def to_json(self) -> dict[str, Any]:
        """Plain values for the file (reasoning only when there is some)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.stats is not None:
            out["stats"] = dict(self.stats)
        if self.reasoning:
            out["reasoning"] = self.reasoning
        return out


@dataclass(frozen=True)
class Sampling:
    """The sampling settings a conversation remembers."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    repetition_penalty: float = 1.1


@dataclass(frozen=True)
class Conversation:
    """A chat: its turns in order, the system prompt and sampling it uses."""

    id: str
    title: str = "New chat"
    created: float = 0.0
    updated: float = 0.0
    system: str = ""
    turns: tuple[Turn, ...] = ()
    sampling: Sampling = field(default_factory=Sampling)

    @classmethod
    def new(cls, system: str = "", sampling: Sampling | None = None) -> Conversation:
        """An empty conversation with a fresh id."""
        now = time.time()
        return cls(uuid.uuid4().hex, "New chat", now, now, system, (), sampling or Sampling())

    def with_turn(self, turn: Turn) -> Conversation:
        """This conversation with one more turn (its first question names it)."""
        if turn.role not in ROLES:
            raise ValueError(f"a turn's role is one of {ROLES}, not {turn.role!r}")
        title = self.title
        if not self.turns and turn.role == "user":
            title = _title(turn.content)
        return replace(self, turns=self.turns + (turn,), title=title, updated=time.time())

    def without_last_answer(self) -> Conversation:
        """This conversation up to its last question (to regenerate the answer)."""
        turns = self.turns
        while turns and turns[-1].role == "assistant":
            turns = turns[:-1]
        return replace(self, turns=turns, updated=time.time())

    def renamed(self, title: str) -> Conversation:
        """This conversation under another title (spaces collapsed); ValueError for an empty one."""
        title = " ".join(title.split())
        if not title:
            raise ValueError("a conversation's title cannot be empty: type a few words")
        return replace(self, title=title)       # not "updated": its turns did not change

    def matches(self, query: str) -> bool:
        """Whether every word of query occurs (any case) in the title or in some turn's text."""
        words = query.casefold().split()
        if not words:
            return True
        text = "\n".join([self.title, *(t.content for t in self.turns)]).casefold()
        return all(w in text for w in words)

    def branched(self, index: int, question: str) -> tuple[Conversation, Conversation]:
        """Edit question `index` to `question`: (this conversation cut before that question and asking the new one,
        the whole old conversation under a new id, titled "<title> (branch)", so that nothing is lost)."""
        if not 0 <= index < len(self.turns) or self.turns[index].role != "user":
            raise ValueError(f"turn {index} is not a question of this conversation ({len(self.turns)} turns)")
        if not question.strip():
            raise ValueError("the edited question is empty: type a question or cancel the edit")
        old = replace(self, id=uuid.uuid4().hex, title=f"{self.title} (branch)")
        cut = replace(self, turns=self.turns[:index], updated=time.time())
        # the title stays (the user may have chosen it), unless it was the edited first question's
        if index == 0 and self.title == _title(self.turns[0].content):
            cut = replace(cut, title="New chat")
        return cut.with_turn(Turn("user", question)), old

    def regenerated(self, index: int) -> tuple[Conversation, Conversation]:
        """Write answer `index` again: (this conversation cut before that answer, to be answered anew, the whole old
        conversation under a new id, titled "<title> (branch)", so that the old answer stays reachable)."""
        if not 0 < index < len(self.turns) or self.turns[index].role != "assistant":
            raise ValueError(f"turn {index} is not an answer of this conversation ({len(self.turns)} turns)")
        if self.turns[index - 1].role != "user":
            raise ValueError(f"answer {index} follows no question: there is nothing to answer again")
        old = replace(self, id=uuid.uuid4().hex, title=f"{self.title} (branch)")
        return replace(self, turns=self.turns[:index], updated=time.time()), old

    def context_tokens(self) -> int | None:
        """Tokens of the context the last answer used (its prompt and itself, as the engine counted them);
        None when the last turn is no answer or its stats do not say."""
        if not self.turns or self.turns[-1].role != "assistant" or not self.turns[-1].stats:
            return None
        used = self.turns[-1].stats.get("context_tokens")
        return int(used) if isinstance(used, (int, float)) else None

    def to_markdown(self) -> str:
        """The conversation as a Markdown document: title, system prompt, then each turn under its speaker."""
        out = [f"# {self.title}", ""]
        if self.system.strip():
            out += ["**System prompt**", "", *(f"> {line}" for line in self.system.splitlines()), ""]
        for turn in self.turns:
            out += [f"## {'You' if turn.role == 'user' else 'Assistant'}", ""]
            if turn.reasoning:
                out += ["<details><summary>Reasoning</summary>", "", turn.reasoning.strip(), "", "</details>", ""]
            out += [turn.content.rstrip(), ""]
            if turn.stats and turn.stats.get("model"):
                out += [f"*{turn.stats['model']}, {turn.stats.get('tokens', 0)} tokens*", ""]
        return "\n".join(out)

    def messages(self) -> list[dict[str, str]]:
        """The chat template's input: the system prompt (when set), then the turns (an answer's reasoning as
        `reasoning_content`: the template decides whether to keep it)."""
        head = [{"role": "system", "content": self.system}] if self.system.strip() else []
        return head + [{"role": t.role, "content": t.content, **({"reasoning_content": t.reasoning} if t.reasoning
                                                                 else {})} for t in self.turns]

    def to_json(self) -> dict[str, Any]:
        """The file's content."""
        s = self.sampling
        return {
            "format": FORMAT, "version": VERSION, "id": self.id, "title": self.title,
            "created": self.created, "updated": self.updated, "system": self.system,
            "sampling": {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens,
                         "repetition_penalty": s.repetition_penalty},
            "turns": [t.to_json() for t in self.turns],
        }

    @classmethod
    def from_json(cls, data: Any) -> Conversation:
        """A conversation from a file's content; ValueError naming what is wrong."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not a Colibri conversation")
        if data.get("version") != VERSION:
            raise ValueError(f"version {data.get('version')} is not {VERSION}")
        try:
            turns = []
            for t in data["turns"]:
                if t["role"] not in ROLES or not isinstance(t["content"], str):
                    raise ValueError(f"a turn with role {t['role']!r} is not a chat turn")
                reasoning = t.get("reasoning", "")
                if not isinstance(reasoning, str):
                    raise ValueError(f"a turn's reasoning is {type(reasoning).__name__}, not text")
                turns.append(Turn(t["role"], t["content"], t.get("stats"), reasoning))
            known = Sampling.__dataclass_fields__
            sampling = Sampling(**{k: v for k, v in (data.get("sampling") or {}).items() if k in known})
            return cls(str(data["id"]), str(data["title"]), float(data["created"]), float(data["updated"]),
                       str(data.get("system", "")), tuple(turns), sampling)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"missing or malformed field: {exc}") from None


EXPORTS = {".md": "Markdown", ".markdown": "Markdown", ".json": "JSON"}


def export(conversation: Conversation, path: str | Path) -> Path:
    """Write a conversation to path atomically, as Markdown (.md, .markdown) or as its JSON file (.json)."""
    path = Path(path)
    kind = EXPORTS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"{path.name}: export to a file ending in {', '.join(EXPORTS)} (Markdown or JSON)")
    with atomic_file(path) as f:                # the user's own file: the usual permissions
        if kind == "JSON":
            json.dump(conversation.to_json(), f, ensure_ascii=False, indent=1)
            f.write("\n")
        else:
            f.write(conversation.to_markdown())
    return path


def _title(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


class ConversationStore:
    """The conversations of one folder (default: the user data folder's `conversations`)."""

    def __init__(self, folder: str | Path | None = None):
        self.folder = Path(folder) if folder is not None else conversations_dir()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.skipped: dict[Path, str] = {}      # unreadable files and why (warned once each)

    def path(self, conversation_id: str) -> Path:
        """The file of a conversation."""
        if not conversation_id or not all(c.isalnum() or c in "-_" for c in conversation_id):
            raise ValueError(f"conversation id {conversation_id!r}: letters, digits, - and _ only")
        return self.folder / f"{conversation_id}.json"

    def list(self) -> list[Conversation]:
        """Every readable conversation, the latest updated first; unreadable files are skipped with a warning."""
        found = []
        for path in sorted(self.folder.glob("*.json")):
            try:
                conv = Conversation.from_json(json.loads(path.read_text(encoding="utf-8")))
                if path.stem != conv.id:
                    raise ValueError(f"it holds conversation {conv.id!r}, not {path.stem!r}")
            except (OSError, UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
                if path not in self.skipped:
                    log.warning("conversation file %s skipped (left as it is): %s", path, exc)
                self.skipped[path] = str(exc)
                continue
            self.skipped.pop(path, None)
            found.append(conv)
        return sorted(found, key=lambda c: c.updated, reverse=True)

    def load(self, conversation_id: str) -> Conversation:
        """One conversation; ValueError or OSError when its file is missing or unreadable."""
        return Conversation.from_json(json.loads(self.path(conversation_id).read_text(encoding="utf-8")))

    def save(self, conversation: Conversation) -> Path:
        """Write a conversation atomically (temporary file, fsync, rename); refuses to replace an unreadable file."""
        path = self.path(conversation.id)
        if path in self.skipped and path.exists():
            raise ValueError(f"{path} could not be read ({self.skipped[path]}); it is kept as it is, not overwritten")
        with atomic_file(path, public=False) as f:      # conversations are private
            json.dump(conversation.to_json(), f, ensure_ascii=False, indent=1)
            f.write("\n")
        return path

    def delete(self, conversation_id: str) -> None:
        """Remove a conversation's file (a missing one is no error)."""
        self.path(conversation_id).unlink(missing_ok=True)
