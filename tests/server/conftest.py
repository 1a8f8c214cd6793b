"""Fixtures the server tests share: each module gets its own tiny 4-bit MoE container and the model loaded from it
directly, whose answers (or logits) the server must give."""

from __future__ import annotations

import pytest

from app.hub.convert import ConvertSettings, convert
from engine.loader import load_model
from support.tiny_chat import tiny_moe


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    src = tiny_moe(tmp_path_factory.mktemp("moe"))
    return convert(src, tmp_path_factory.mktemp("c") / "tiny", ConvertSettings(bits=4), log=lambda m: None)


@pytest.fixture(scope="module")
def model(container):
    """The same model loaded directly, for the answers the server must give."""
    loaded = load_model(container)
    yield loaded
    loaded.close()
