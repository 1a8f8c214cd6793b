"""The text policy (issue 29): text that is not valid Unicode is repaired with U+FFFD, never refused.

`clean_text` is checked against Python's own `errors="replace"` decoding, then every tokenizer kind
the tests can build is fuzzed with lone surrogates and surrogateescape'd bytes: encoding never
raises, gives the ids of the cleaned text, and (where the tokenizer round-trips) decodes to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.generation.generate import StopStrings
from engine.tokenizer import Tokenizer, clean_text
from support.tokenizer import TEXTS, tiny_llama_metadata

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])
# Valid text and lone surrogates mixed, surrogates often enough to matter
DIRTY = st.text(st.one_of(st.characters(), SURROGATES, st.sampled_from(" \n<|>")), max_size=40)
# What argv or a surrogateescape stream gives for arbitrary bytes
ESCAPED = st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape"))
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ---- clean_text --------------------------------------------------------------------------------


def test_the_issue_cases():
    assert clean_text("hi \ud800") == "hi \ufffd"
    assert clean_text(b"hi \xff".decode("utf-8", "surrogateescape")) == "hi \ufffd"
    # an encoded surrogate: three invalid bytes, three replacements, as stdin with errors="replace" reads it
    assert clean_text(b"hi \xed\xa0\x80".decode("utf-8", "surrogateescape")) == "hi \ufffd\ufffd\ufffd"
    # JSON combines an escaped pair into one astral code point: it is valid and stays as it is
    emoji = json.loads('"\\ud83d\\ude00"')
    assert emoji == "\U0001F600" and clean_text(emoji) is emoji
    # two separate surrogates in a str are not a character: each is replaced
    assert clean_text("\ud83d\ude00") == "\ufffd\ufffd"


@pytest.mark.parametrize("text", TEXTS)
def test_valid_text_is_the_same_object(text):
    assert clean_text(text) is text


@given(st.text(max_size=200))
def test_valid_text_is_unchanged(text):
    assert clean_text(text) is text


@given(st.binary(max_size=200))
def test_escaped_bytes_read_as_errors_replace_reads_them(data):
    assert clean_text(data.decode("utf-8", "surrogateescape")) == data.decode("utf-8", "replace")


@given(DIRTY)
def test_cleaned_text_is_valid_and_keeps_its_valid_characters(text):
    cleaned = clean_text(text)
    cleaned.encode("utf-8")                                 # strict: raises if anything invalid is left
    assert clean_text(cleaned) is cleaned                   # once: cleaning twice changes nothing more
    kept = [c for c in text if not 0xD800 <= ord(c) <= 0xDFFF]
    assert [c for c in cleaned if c != "\ufffd"] == [c for c in kept if c != "\ufffd"]


def test_stop_strings_are_cleaned_like_prompts():
    matcher = StopStrings(["x\ud800", ""])
    assert matcher.stops == ["x\ufffd"]
    assert matcher.feed("ab x\ufffd tail") == ("ab ", True)


# ---- every tokenizer kind ----------------------------------------------------------------------


def _byte_level_folder(folder: Path) -> Path:
    """A small byte-level BPE folder trained here (a post-processor adds <s>) with a chat template."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([t for t in TEXTS if t] * 3, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if tools %}{{ tools | tojson }}{% endif %}"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _char_folder(folder: Path) -> Path:
    """The tiny chat models' character tokenizer: unknown characters become <eos> (so it cannot round-trip)."""
    from support.tiny_chat import add_chat_tokenizer

    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return add_chat_tokenizer(folder)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory, smol) -> dict[str, tuple[Tokenizer, bool]]:
    """Every kind, by name: (tokenizer, whether decode(encode(text)) gives the text back)."""
    root = tmp_path_factory.mktemp("kinds")
    return {
        # SmolLM2's vocabulary lacks a few bytes (0xF1 among them), as transformers' reading of it does
        "gguf byte-level BPE (SmolLM2)": (smol, False),
        "gguf SentencePiece BPE with byte fallback": (Tokenizer.from_gguf_metadata(tiny_llama_metadata(
            **{"tokenizer.chat_template": "{% for m in messages %}<s>{{ m['content'] }}{% endfor %}"})), False),
        "folder byte-level BPE": (Tokenizer.from_folder(_byte_level_folder(root / "bpe")), True),
        "folder character vocabulary": (Tokenizer.from_folder(_char_folder(root / "chars")), False),
    }


KINDS = ["gguf byte-level BPE (SmolLM2)", "gguf SentencePiece BPE with byte fallback", "folder byte-level BPE",
         "folder character vocabulary"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_issue_prompts_encode(tokenizers, kind):
    tok, _ = tokenizers[kind]
    for raw in ("hi \ud800", b"hi \xff".decode("utf-8", "surrogateescape"),
                b"hi \xed\xa0\x80".decode("utf-8", "surrogateescape")):
        assert tok.encode(raw) == tok.encode(clean_text(raw))
        assert tok.encode_chat([{"role": "user", "content": raw}]) == \
            tok.encode_chat([{"role": "user", "content": clean_text(raw)}])


@pytest.mark.parametrize("kind", KINDS)
@FUZZ
@given(text=st.one_of(DIRTY, ESCAPED))
def test_fuzzed_text_encodes_as_its_cleaned_text(tokenizers, kind, text):
    tok, round_trips = tokenizers[kind]
    cleaned = clean_text(text)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == tok.encode(cleaned, add_special_tokens=False)
    assert tok.encode(text) == tok.encode(cleaned)          # with BOS/EOS too
    if round_trips:
        assert tok.decode(ids) == cleaned
    if cleaned is text:                                     # valid text: byte-identical, same ids
        assert cleaned.encode("utf-8") == text.encode("utf-8")


@pytest.mark.parametrize("kind", ["gguf byte-level BPE (SmolLM2)", "folder byte-level BPE"])
@FUZZ
@given(system=DIRTY, user=st.one_of(DIRTY, ESCAPED), tool=DIRTY)
def test_fuzzed_chat_messages_and_tools_render_cleaned(tokenizers, kind, system, user, tool):
    tok, _ = tokenizers[kind]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    tools = [{"type": "function", "function": {"name": tool, "description": user}}]
    rendered = tok.apply_chat_template(messages, tools=tools)
    rendered.encode("utf-8")                                # valid text, whatever came in
    clean_messages = [{**m, "content": clean_text(m["content"])} for m in messages]
    clean_tools = [{"type": "function", "function": {"name": clean_text(tool), "description": clean_text(user)}}]
    assert rendered == tok.apply_chat_template(clean_messages, tools=clean_tools)
    assert tok.encode_chat(messages, tools=tools) == tok.encode(rendered, add_special_tokens=False)
    assert messages[1]["content"] is user                   # the caller's messages are not changed
