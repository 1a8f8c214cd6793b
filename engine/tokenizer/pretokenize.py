"""How a GGUF byte-level vocabulary splits text before BPE, keyed by `tokenizer.ggml.pre`.

A GGUF does not carry the pre-tokenizer of the model's tokenizer.json, only a name for it that
llama.cpp's converter picked by hashing the original tokenizer's output. Each name stands for a
list of split regexes applied one after the other (each match and each gap between matches
becomes a piece of its own), as the original tokenizer.json wrote them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from tokenizers import Regex, normalizers, pre_tokenizers

# The GPT-2 split, as GPT-2's encoder and the `tokenizers` ByteLevel pre-tokenizer write it.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2 differs from Llama-3 only in taking digits one by one.
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3.5 keeps combining marks inside words.
QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DeepSeek-LLM spells its letter classes out as ranges (Latin, Greek, Cyrillic, Armenian, ...).
_DEEPSEEK_LETTERS = (  # code points, not characters: an editor's NFC pass would break the ranges
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[" + _DEEPSEEK_LETTERS + r"]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _CJK_HANGUL,
    r"\p{N}+",
)
DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")
DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


@dataclass(frozen=True)
class PreTokenizerSpec:
    """What one `tokenizer.ggml.pre` name means: split regexes and the flags llama.cpp ties to it."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is taken whole (Llama-3's BPE option)
    add_bos: bool = False  # llama.cpp's default when the file has no `add_bos_token` key
    nfc: bool = False  # the original tokenizer.json normalizes to NFC first (Qwen)


def _table() -> dict[str, PreTokenizerSpec]:
    gpt2 = PreTokenizerSpec((GPT2,))
    digits_then_gpt2 = PreTokenizerSpec((r"\p{N}", GPT2))
    llama3 = PreTokenizerSpec((LLAMA3,), ignore_merges=True, add_bos=True)
    qwen2 = PreTokenizerSpec((QWEN2,), nfc=True)
    table: dict[str, PreTokenizerSpec] = {}
    for name in ("default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de",
                 "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code", "roberta-bpe", "gigachat",
                 "exaone4", "a.x-4.0", "mellum", "modern-bert"):
        table[name] = gpt2
    for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"):
        table[name] = digits_then_gpt2
    for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                 "jina-v5-nano"):
        table[name] = llama3
    for name in ("dbrx", "smaug-bpe", "glm4", "chatglm-bpe"):
        table[name] = PreTokenizerSpec((LLAMA3,))
    table["qwen2"] = qwen2
    table["deepseek-r1-qwen"] = qwen2  # DeepSeek-R1 distilled into Qwen2.5 keeps Qwen's tokenizer
    for name in ("kormo", "f2llmv2", "megrez", "stablelm2"):
        table[name] = PreTokenizerSpec((QWEN2,))
    table["qwen35"] = PreTokenizerSpec((QWEN35,), nfc=True)
    for name in ("gpt-4o", "llama4", "kanana2", "talkie"):
        table[name] = PreTokenizerSpec((GPT4O,))
    table["tekken"] = PreTokenizerSpec((TEKKEN,), ignore_merges=True, add_bos=True)
    table["deepseek-llm"] = PreTokenizerSpec(DEEPSEEK_LLM)
    table["deepseek-coder"] = PreTokenizerSpec(DEEPSEEK_CODER)
    table["deepseek-v3"] = PreTokenizerSpec(DEEPSEEK_V3)
    table["falcon"] = PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"))
    for name in ("poro-chat", "bloom", "gpt3-finnish"):
        table[name] = PreTokenizerSpec((_BLOOM,))
    table["viking"] = PreTokenizerSpec((_BLOOM, r"\p{N}"))
    return table


PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = _table()


def pre_tokenizer_spec(pre: str | None, source: str = "") -> PreTokenizerSpec:
    """The spec for a `tokenizer.ggml.pre` value; an unknown or missing one falls back to GPT-2's split."""
    if pre is None or pre == "":
        pre = "default"
    spec = PRE_TOKENIZERS.get(pre)
    if spec is None:
        warnings.warn(
            f"{source or 'GGUF'}: unknown tokenizer.ggml.pre {pre!r}; splitting text with the GPT-2 "
            "regex, so some prompts may tokenize differently from the original model",
            stacklevel=3,
        )
        spec = PRE_TOKENIZERS["default"]
    return spec


def byte_level_pre_tokenizer(spec: PreTokenizerSpec) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pre-tokenizer: each regex split in turn, then bytes mapped to the GPT-2 alphabet."""
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in spec.splits
    ]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def byte_level_normalizer(spec: PreTokenizerSpec) -> normalizers.Normalizer | None:
    """The normalizer the original tokenizer.json had, if any."""
    return normalizers.NFC() if spec.nfc else None
