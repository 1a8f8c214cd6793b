"""Tiny checkpoints that read text (a character tokenizer) and a small probes folder, for moefy and atlas tests."""

from __future__ import annotations

import json
from pathlib import Path

from app.atlas.probes import PROBES_DIR, load_probes

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"()[]{}-+*/=<>_#\n"


def add_char_tokenizer(folder: Path) -> Path:
    """Give a tiny checkpoint (vocab >= 100) a character-level tokenizer.json, so it can read text."""
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>"}))
    return folder


def tiny_probes(folder: Path, topics: int = 3, prompts: int = 6) -> Path:
    """A small probes folder: the first prompts of a few shipped topics, and a short held-out text."""
    folder.mkdir(parents=True, exist_ok=True)
    for topic in load_probes()[:topics]:
        data = {"topic": topic.topic, "title": topic.title, "prompts": list(topic.prompts[:prompts])}
        (folder / f"{topic.topic}.json").write_text(json.dumps(data))
    (folder / "heldout.txt").write_text((PROBES_DIR / "heldout.txt").read_text(encoding="utf-8")[:1500])
    return folder
