"""engine.tokenizer against transformers: SmolLM2's GGUF tokenizer, Hugging Face folders, a tiny
SentencePiece-style GGUF, the pre-tokenizer table, and the errors for broken files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import regex

from engine.errors import TokenizerError
from engine.tokenizer import Tokenizer
from support.tokenizer import SP, TEXTS, TINY_PIECES, tiny_llama_metadata  # noqa: F401

# ---- a tiny SentencePiece-style ("llama") vocabulary (tests/support/tokenizer.py) ------------------

def write_tiny_gguf(path: Path, meta: dict) -> None:
    """Write `meta` as a GGUF file transformers can load (a llama header and no tensors)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value in [("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                        ("feed_forward_length", 16), ("head_count", 1), ("head_count_kv", 1)]:
        getattr(writer, f"add_{name}")(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    writer.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    writer.add_add_eos_token(meta["tokenizer.ggml.add_eos_token"])
    writer.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- SmolLM2 GGUF vs transformers ----------------------------------------------------------------


@pytest.mark.parity
@pytest.mark.parametrize("add_special", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_gguf_encode_matches_transformers(smol, hf_smol, text, add_special):
    assert smol.encode(text, add_special_tokens=add_special) == hf_smol.encode(text, add_special_tokens=add_special)


@pytest.mark.parity
@pytest.mark.parametrize("text", TEXTS)
def test_gguf_decode_round_trips_and_matches_transformers(smol, hf_smol, text):
    ids = smol.encode(text, add_special_tokens=False)
    assert smol.decode(ids) == text
    for skip in (False, True):
        assert smol.decode(ids, skip_special_tokens=skip) == hf_smol.decode(ids, skip_special_tokens=skip)


@pytest.mark.parity
def test_gguf_special_tokens_match_transformers(smol, hf_smol):
    assert smol.bos_token_id == hf_smol.bos_token_id == 1
    assert smol.eos_token_id == hf_smol.eos_token_id == 2
    assert smol.pad_token_id == hf_smol.pad_token_id
    assert smol.vocab_size == len(hf_smol) == 49152
    # special_ids are the tokens decode(skip_special_tokens=True) drops: all 17 control tokens of the
    # file. (transformers' all_special_ids lists only the named ones, {0, 1, 2}, a subset.)
    skipped = {i for i, t in hf_smol.added_tokens_decoder.items() if t.special}
    assert smol.special_ids == skipped and len(skipped) == 17
    assert set(hf_smol.all_special_ids) <= smol.special_ids
    assert smol.has_chat_template
    # SmolLM2's GGUF says add_bos_token = false: nothing is added around the text
    assert smol.encode("hi") == smol.encode("hi", add_special_tokens=False)


@pytest.mark.parity
def test_smollm_digits_split_like_the_original(smol, hf_smol, smol_metadata):
    # SmolLM2's own tokenizer.json splits every digit off (Digits(individual_digits=True)) before the
    # GPT-2 regex, and llama.cpp's "smollm" pre-type does the same; transformers' GGUF conversion
    # keeps the plain GGUF-2 split. The pieces differ ...
    ours = [p for p, _ in smol.backend.pre_tokenizer.pre_tokenize_str("x 2024")]
    theirs = [p for p, _ in hf_smol.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x 2024")]
    assert ours == ["x", "Ġ", "2", "0", "2", "4"]
    assert theirs == ["x", "Ġ2024"]
    # ... but the ids cannot: SmolLM2's vocabulary has no token with two digits, so BPE splits
    # " 2024" into "Ġ" and single digits either way (the test above compares ids on many numbers).
    digit_runs = [t for t in smol_metadata["tokenizer.ggml.tokens"] if regex.fullmatch(r"Ġ?\p{N}{2,}", t)]
    assert digit_runs == []


# ---- pre-tokenizer table: our splits against llama.cpp's regexes run with the `regex` module -----

GPT2_LLAMACPP = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_LLAMACPP = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_LLAMACPP = LLAMA3_LLAMACPP.replace(r"\p{N}{1,3}", r"\p{N}")
DEEPSEEK_V3_LLAMACPP = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
REFERENCE_SPLITS = {
    "gpt2": [GPT2_LLAMACPP],
    "default": [GPT2_LLAMACPP],
    "smollm": [r"\p{N}", GPT2_LLAMACPP],
    "starcoder": [r"\p{N}", GPT2_LLAMACPP],
    "llama-bpe": [LLAMA3_LLAMACPP],
    "qwen2": [QWEN2_LLAMACPP],
    "deepseek-v3": DEEPSEEK_V3_LLAMACPP,
}
SPLIT_TEXTS = TEXTS + ["I'LL be there, it'S 12345 o'clock!!\n\n  x", "x = a+b*(c-1)/2 # sum\n"]


def _reference_split(text: str, patterns: list[str]) -> list[str]:
    """llama.cpp's way: every regex splits every piece; matches and the gaps between them are pieces."""
    pieces = [text]
    for pattern in patterns:
        out = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(pattern, piece):
                if m.start() > pos:
                    out.append(piece[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(piece):
                out.append(piece[pos:])
        pieces = out
    return pieces


@pytest.mark.parametrize("pre", sorted(REFERENCE_SPLITS))
def test_pre_tokenizer_splits_like_llama_cpp(smol, pre, smol_metadata):
    from tokenizers import pre_tokenizers

    meta = dict(smol_metadata, **{"tokenizer.ggml.pre": pre})
    ours = Tokenizer.from_gguf_metadata(meta, "test.gguf").backend.pre_tokenizer
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for text in SPLIT_TEXTS:
        expected = [to_bytes.pre_tokenize_str(p)[0][0] for p in _reference_split(text, REFERENCE_SPLITS[pre])]
        assert [p for p, _ in ours.pre_tokenize_str(text)] == expected, (pre, text)


def test_deepseek_llm_split_hand_derived(smol, smol_metadata):
    meta = dict(smol_metadata, **{"tokenizer.ggml.pre": "deepseek-llm"})
    pre = Tokenizer.from_gguf_metadata(meta, "test.gguf").backend.pre_tokenizer
    # "[\r\n]" isolates the newline; "\s?[letters]+" takes "Hello"; "\s?[ASCII punctuation]+" takes ","
    # and "!"; the CJK class takes "世界"; "\p{N}+" takes "123"; the gaps (single spaces) stay pieces.
    from tokenizers import pre_tokenizers

    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    expected = ["Hello", ",", " ", "世界", "!", " ", "123", "\n", "ok"]
    pieces = [p for p, _ in pre.pre_tokenize_str("Hello, 世界! 123\nok")]
    assert pieces == [to_bytes.pre_tokenize_str(p)[0][0] for p in expected]


def test_llama3_and_qwen2_flags(smol, smol_metadata):
    llama3 = Tokenizer.from_gguf_metadata(
        {k: v for k, v in smol_metadata.items() if k != "tokenizer.ggml.add_bos_token"}
        | {"tokenizer.ggml.pre": "llama-bpe"}, "l3.gguf")
    assert llama3.backend.model.ignore_merges  # Llama-3's tokenizer.json sets it
    assert llama3.encode("hi")[0] == llama3.bos_token_id  # llama.cpp adds BOS for llama3 unless told not to
    qwen2 = Tokenizer.from_gguf_metadata(dict(smol_metadata, **{"tokenizer.ggml.pre": "qwen2"}), "q.gguf")
    # Qwen2's tokenizer.json normalizes to NFC (transformers' GGUF conversion leaves that out):
    # a decomposed "é" encodes like the composed one
    assert qwen2.encode("caf\u0065\u0301") == qwen2.encode("caf\u00e9")


def test_unknown_pre_type_warns_and_uses_gpt2(smol, smol_metadata):
    meta = dict(smol_metadata, **{"tokenizer.ggml.pre": "no-such-pre"})
    with pytest.warns(UserWarning, match="no-such-pre"):
        tok = Tokenizer.from_gguf_metadata(meta, "odd.gguf")
    text = "don't 123 go"
    assert [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)] == ["don", "'t", "Ġ123", "Ġgo"]


# ---- a tiny "llama" (SentencePiece-style) GGUF ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path, tiny_llama_metadata())
    return path


@pytest.fixture(scope="module")
def tiny(tiny_gguf) -> Tokenizer:
    from engine.formats.gguf_meta import gguf_metadata, open_gguf

    return Tokenizer.from_gguf_metadata(gguf_metadata(open_gguf(tiny_gguf)), tiny_gguf.name)


@pytest.mark.parity
@pytest.mark.parametrize("text", ["hello world", "the cat is in a hat!", "héllo 中 x", "hello\n\nworld",
                                  "world,hello", "té", "", "cat  cat   cat"])
def test_tiny_llama_gguf_matches_transformers(tiny, tiny_gguf, text):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    for add_special in (True, False):
        assert tiny.encode(text, add_special) == hf.encode(text, add_special_tokens=add_special)
    ids = tiny.encode(text)
    assert tiny.decode(ids) == hf.decode(ids)
    assert tiny.decode(ids, skip_special_tokens=True) == text


def test_tiny_llama_gguf_hand_derived(tiny):
    tok = tiny.token_to_id
    # "▁" prefix, then merges by score: ▁h+e -> ▁he, l+l -> ll ... -> ▁hello; BOS added by default
    assert tiny.encode("hello world") == [1, tok(SP + "hello"), tok(SP + "world")]
    # 中 is no token: byte fallback gives its three UTF-8 bytes
    assert tiny.encode("中", add_special_tokens=False) == [tok(SP)] + [tok(f"<0x{b:02X}>") for b in "中".encode()]
    assert tiny.decode(tiny.encode("中")) == "<s> 中"
    assert tiny.decode(tiny.encode("中"), skip_special_tokens=True) == "中"
    # Where transformers' GGUF conversion differs (Metaspace with prepend_scheme "first"), we follow
    # llama.cpp and SentencePiece itself: the "▁" prefix is added even before a leading space
    # (" hello" -> "▁", "▁hello", Llama-2's well-known token 29871), and again after every special
    # token. transformers gives "▁hello" for " hello" (dropping the space on decode) and "world"
    # without "▁" after "<s>".
    assert tiny.encode(" hello", add_special_tokens=False) == [tok(SP), tok(SP + "hello")]
    assert tiny.decode(tiny.encode(" hello", add_special_tokens=False)) == " hello"
    assert tiny.encode("hello<s>world", add_special_tokens=False) == [tok(SP + "hello"), 1, tok(SP + "world")]


def test_tiny_llama_flags():
    no_prefix = Tokenizer.from_gguf_metadata(tiny_llama_metadata(**{"tokenizer.ggml.add_space_prefix": False,
                                                                    "tokenizer.ggml.add_eos_token": True}))
    tok = no_prefix.token_to_id
    # No "▁" in front: h+e -> he, l+l -> ll, ll+o -> llo ("hello" alone is no token), then ▁world; EOS added
    assert no_prefix.encode("hello world") == [1, tok("he"), tok("llo"), tok(SP + "world"), 2]
    assert no_prefix.decode(no_prefix.encode("hello world"), skip_special_tokens=True) == "hello world"
    # No scores and no merges: nothing to build BPE from
    meta = tiny_llama_metadata()
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(TokenizerError, match="scores"):
        Tokenizer.from_gguf_metadata(meta, "bad.gguf")


def test_gguf_metadata_errors():
    with pytest.raises(TokenizerError, match="x.gguf.*no tokenizer"):
        Tokenizer.from_gguf_metadata({"general.architecture": "llama"}, "x.gguf")
    with pytest.raises(TokenizerError, match="'bert' is not supported"):
        Tokenizer.from_gguf_metadata(tiny_llama_metadata(**{"tokenizer.ggml.model": "bert"}), "x.gguf")
    with pytest.raises(TokenizerError, match="x.gguf: tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata(tiny_llama_metadata(**{"tokenizer.ggml.tokens": None}), "x.gguf")
    with pytest.raises(TokenizerError, match="token_type"):
        Tokenizer.from_gguf_metadata(tiny_llama_metadata(**{"tokenizer.ggml.token_type": [1, 2]}), "x.gguf")
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_gguf_metadata(tiny_llama_metadata(**{"tokenizer.ggml.model": "gpt2"}), "x.gguf")


# ---- Hugging Face folders ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_folder(hf_smol, tmp_path_factory) -> Path:
    """transformers' SmolLM2 tokenizer saved as a folder: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
    folder = tmp_path_factory.mktemp("smol-folder")
    hf_smol.save_pretrained(str(folder))
    assert (folder / "chat_template.jinja").is_file()
    return folder


def _compare_folder(folder: Path, texts=TEXTS) -> Tokenizer:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_folder(folder)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    assert ours is not None
    for text in texts:
        for add_special in (True, False):
            ids = ours.encode(text, add_special)
            assert ids == theirs.encode(text, add_special_tokens=add_special), text
            for skip in (True, False):
                assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    assert ours.vocab_size == len(theirs)
    return ours


CONVERSATION = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "2+2?"}]


@pytest.mark.parity
def test_folder_matches_transformers(smol_folder):
    from transformers import AutoTokenizer

    ours = _compare_folder(smol_folder)
    theirs = AutoTokenizer.from_pretrained(str(smol_folder))
    for gen in (True, False):
        assert ours.apply_chat_template(CONVERSATION, add_generation_prompt=gen) == theirs.apply_chat_template(
            CONVERSATION, add_generation_prompt=gen, tokenize=False)
        assert ours.encode_chat(CONVERSATION, add_generation_prompt=gen) == theirs.apply_chat_template(
            CONVERSATION, add_generation_prompt=gen, tokenize=True, return_dict=False)


@pytest.mark.parity
def test_folder_template_in_tokenizer_config(smol_folder, tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "cfg-template"
    shutil.copytree(smol_folder, folder)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}" + template  # different from the GGUF's: proves which one is read
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_folder(folder)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    rendered = ours.apply_chat_template(CONVERSATION)
    assert rendered.startswith("<|im_start|><|im_start|>system")
    assert rendered == theirs.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    # chat_template.jinja wins over the config entry, as in transformers
    (folder / "chat_template.jinja").write_text(template)
    assert Tokenizer.from_folder(folder).apply_chat_template(CONVERSATION) == rendered[len("<|im_start|>"):]


def _tiny_bpe_folder(folder: Path, tokenizer_class: str) -> None:
    """A small byte-level BPE trained here, with a post-processor that adds <s> (and </s> to pairs)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([t for t in TEXTS if t] * 3, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A </s> $B", special_tokens=[("<s>", 1), ("</s>", 2)])
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": tokenizer_class, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "add_bos_token": True, "chat_template": "{% for m in messages %}{{ bos_token + m['content'] }}{% endfor %}"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("tokenizer_class", ["PreTrainedTokenizerFast", "TokenizersBackend"])
def test_folder_with_bos_post_processor(tmp_path, tokenizer_class):
    folder = tmp_path / "bpe"
    _tiny_bpe_folder(folder, tokenizer_class)
    ours = _compare_folder(folder)
    assert ours.encode("Hello")[0] == ours.bos_token_id == 1
    assert ours.encode("Hello", add_special_tokens=False)[0] != 1
    # The chat prompt already holds its BOS as text: encode_chat must not add a second one
    assert ours.encode_chat([{"role": "user", "content": "Hello"}]) == ours.encode("<s>Hello", False)


def test_llama_style_folder(tmp_path):
    # A Llama/Mistral-style folder: SentencePiece BPE with byte fallback, Metaspace pre-tokenizer,
    # a post-processor adding <s>, tokenizer_class LlamaTokenizer. Note: for such a class
    # transformers 5 rebuilds normalizer, pre-tokenizer and decoder from its own defaults instead of
    # reading them from tokenizer.json; we always follow tokenizer.json. The two agree here because
    # this tokenizer.json is what LlamaTokenizer builds; for a legacy Llama-2 tokenizer.json (a
    # Prepend("▁") normalizer) transformers 5 would drop the "▁" before a leading space, which the
    # file (and SentencePiece) keeps.
    from tokenizers import decoders, pre_tokenizers

    backend = Tokenizer.from_gguf_metadata(tiny_llama_metadata()).backend
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SP, prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace(SP, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    folder = tmp_path / "llama"
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": True, "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours = _compare_folder(folder, texts=TEXTS + ["hello<s>world", "the cat</s>"])
    assert ours.encode("hello") == [1, ours.token_to_id(SP + "hello")]


def test_folder_legacy_special_tokens_map(tmp_path):
    folder = tmp_path / "legacy"
    _tiny_bpe_folder(folder, "PreTrainedTokenizerFast")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token", "unk_token"):
        del config[key]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
         "eos_token": "</s>", "pad_token": "<pad>"}))
    ours = _compare_folder(folder, texts=TEXTS[:4] + ["a<pad>b"])
    # "<pad>" is not in tokenizer.json: like transformers we add it as a new special token
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, ours.vocab_size - 1)
    assert ours.pad_token_id in ours.special_ids


def test_folder_without_tokenizer_json_is_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert Tokenizer.from_folder(tmp_path) is None
    with pytest.raises(TokenizerError, match="no such model folder"):
        Tokenizer.from_folder(tmp_path / "missing")


def test_corrupt_folder_files_name_the_file(smol_folder, tmp_path):
    broken = tmp_path / "broken-json"
    shutil.copytree(smol_folder, broken)
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not valid JSON"):
        Tokenizer.from_folder(broken)
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: the tokenizers library cannot load it"):
        Tokenizer.from_folder(broken)

    bad_config = tmp_path / "broken-config"
    shutil.copytree(smol_folder, bad_config)
    (bad_config / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: not valid JSON"):
        Tokenizer.from_folder(bad_config)

    bad_template = tmp_path / "broken-template"
    shutil.copytree(smol_folder, bad_template)
    (bad_template / "chat_template.jinja").unlink()
    config = json.loads((bad_template / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }"
    (bad_template / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_folder(bad_template)  # the tokenizer itself still works without --chat
    assert tok.decode(tok.encode("fine")) == "fine"
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json has a syntax error"):
        tok.apply_chat_template(CONVERSATION)


def test_gguf_tokenizer_saved_as_folder_reads_back_the_same(smol, tmp_path):
    """A GGUF's tokenizer written as Hugging Face files encodes, decodes and renders identically."""
    smol.save(tmp_path)
    again = Tokenizer.from_folder(tmp_path)
    for text in TEXTS:
        for special in (True, False):
            assert again.encode(text, add_special_tokens=special) == smol.encode(text, add_special_tokens=special)
    ids = smol.encode(TEXTS[5])
    assert again.decode(ids) == smol.decode(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert again.encode_chat(messages) == smol.encode_chat(messages)
    assert (again.bos_token_id, again.eos_token_id, again.special_ids) == (smol.bos_token_id, smol.eos_token_id, smol.special_ids)
