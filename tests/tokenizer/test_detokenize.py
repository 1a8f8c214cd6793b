"""Decoding and streaming decoding: push() outputs joined with flush() equal decode() of all ids, for
real text (emoji and CJK span several byte-level tokens) and for seeded random id sequences, on
SmolLM2's byte-level vocabulary, a tiny byte-fallback vocabulary and a word-piece one."""

from __future__ import annotations

import random

import pytest

from engine.tokenizer import StreamDecoder, Tokenizer
from support.tokenizer import TEXTS, tiny_llama_metadata

REPLACEMENT = "\ufffd"
MULTIBYTE = [
    "😀😃😄😁 🎉🎊 👨‍👩‍👧‍👦 👩🏽‍💻 🏳️‍🌈 🇫🇷🇩🇪🇯🇵",
    "中文字符和標點符號。漢字、かな、カナ、한국어 텍스트",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย",
    "math ∑∫√∞ ≠ ≤ ≥ and arrows ←↑→↓ and box ┌─┐",
]


def _stream(tok: Tokenizer, ids: list[int], skip: bool = False) -> list[str]:
    dec = tok.stream_decoder(skip_special_tokens=skip)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS + MULTIBYTE)
def test_stream_equals_decode_on_text(smol, text):
    for add_special in (True, False):
        ids = smol.encode(text, add_special_tokens=add_special)
        for skip in (False, True):
            pieces = _stream(smol, ids, skip)
            assert "".join(pieces) == smol.decode(ids, skip_special_tokens=skip)
            # valid text never shows a replacement character, however its bytes were cut into tokens
            assert not any(REPLACEMENT in p for p in pieces)


@pytest.mark.parity
@pytest.mark.parametrize("text", MULTIBYTE)
def test_multibyte_decode_matches_transformers(smol, hf_smol, text):
    ids = smol.encode(text)
    assert len(ids) > len(text.split())  # characters really span several tokens here
    assert smol.decode(ids) == hf_smol.decode(ids) == text


def test_stream_emits_each_emoji_once_it_is_complete(smol):
    ids = smol.encode("😀")
    assert len(ids) > 1  # four UTF-8 bytes, several byte-level tokens
    pieces = _stream(smol, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and pieces[-2] == "😀" and pieces[-1] == ""


def _check_random(tok: Tokenizer, pool: list[int], seed: int, count: int, max_len: int) -> None:
    rng = random.Random(seed)
    for _ in range(count):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, max_len))]
        for skip in (False, True):
            dec = tok.stream_decoder(skip_special_tokens=skip)
            pushed = [dec.push(i) for i in ids]
            # a push never ends in a replacement character: an unfinished sequence is held back
            assert not any(p.endswith(REPLACEMENT) for p in pushed), ids
            assert "".join(pushed) + dec.flush() == tok.decode(ids, skip_special_tokens=skip), ids


def test_stream_random_sequences_whole_vocab(smol):
    _check_random(smol, list(range(smol.vocab_size)), seed=1, count=300, max_len=40)


def test_stream_random_sequences_of_byte_pieces(smol):
    # Tokens that are not valid UTF-8 alone (pieces of multi-byte characters), mixed with a few
    # ASCII and special tokens: this hits completion, invalid sequences and held-back text.
    partial = [i for i in range(smol.vocab_size) if REPLACEMENT in smol.decode([i])]
    assert len(partial) > 100
    ascii_ids = smol.encode(" a b\n!")
    pool = partial * 4 + ascii_ids + sorted(smol.special_ids)
    _check_random(smol, pool, seed=2, count=400, max_len=24)
    # Real multi-byte text cut at random places and shuffled a little
    rng = random.Random(3)
    real = [i for t in MULTIBYTE for i in smol.encode(t)]
    for _ in range(200):
        start = rng.randrange(len(real))
        ids = real[start:start + rng.randint(1, 30)]
        if rng.random() < 0.5 and len(ids) > 2:
            k = rng.randrange(len(ids) - 1)
            ids[k], ids[k + 1] = ids[k + 1], ids[k]
        assert "".join(_stream(smol, ids)) == smol.decode(ids)


def test_stream_byte_fallback_vocabulary():
    # A SentencePiece-style vocabulary: "<0xXX>" tokens carry raw bytes and the decoder drops the
    # leading "▁" of the text; a run of byte tokens that was valid can turn invalid with the next byte.
    tiny = Tokenizer.from_gguf_metadata(tiny_llama_metadata(), "tiny.gguf")
    for text in ["hello world", " hello  world", "中文 ok", "é😀 cat", "hello<s>world"]:
        ids = tiny.encode(text)
        assert "".join(_stream(tiny, ids)) == tiny.decode(ids)
    byte_ids = [tiny.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    pool = byte_ids + list(range(3)) + list(range(259, tiny.vocab_size)) * 8
    _check_random(tiny, pool, seed=4, count=400, max_len=20)
    # The run E4 B8 AD is "中", but one more continuation byte makes all four bytes invalid
    run = [byte_ids[b] for b in "中".encode()]
    dec = tiny.stream_decoder()
    assert [dec.push(i) for i in run] == ["", "", ""]
    assert dec.push(byte_ids[0x80]) == ""
    assert dec.push(tiny.token_to_id("\u2581cat")) == REPLACEMENT * 4 + " cat"
    assert dec.flush() == ""


def test_stream_word_piece_with_cleanup_decodes_whole_sequence():
    # Word-piece decoding joins "##" pieces and transformers' cleanup rewrites " ," across token
    # borders; such decoders are streamed by decoding the whole sequence, which stays exact.
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    words = ["[UNK]", "[CLS]", "hello", "world", "##s", ",", ".", "don", "'", "t", "n", "##'t", "they", "##re"]
    backend = Backend(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    tok = Tokenizer(backend, {"unk_token": "[UNK]"}, source="wordpiece", clean_up_tokenization_spaces=True)
    assert tok.decode(tok.encode("hello , worlds .")) == "hello, worlds."
    _check_random(tok, list(range(len(words))), seed=5, count=300, max_len=12)


def test_stream_decoder_falls_back_to_whole_sequence():
    # A decoder that spells a lone token differently ("B" alone, "b" in context) breaks the window's
    # context check; the decoder then decodes the whole sequence and stays exact.
    table = {1: "a", 2: "b", 3: "c"}

    def decode(ids):
        return "B" if list(ids) == [2] else "".join(table[i] for i in ids)

    dec = StreamDecoder(decode)
    out = [dec.push(i) for i in (3, 1, 2, 3, 2)] + [dec.flush()]
    # the whole-sequence mode keeps the last few characters until flush (cleanup rules may still change them)
    assert out == ["c", "a", "b", "", "", "cb"]
    assert dec.token_ids == [3, 1, 2, 3, 2]
