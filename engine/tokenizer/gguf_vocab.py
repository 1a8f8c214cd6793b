"""Build a `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata (llama.cpp's key names).

Two vocabulary kinds are supported, named by `tokenizer.ggml.model`:
- "gpt2": byte-level BPE with merges; the split regexes come from `tokenizer.ggml.pre`.
- "llama": SentencePiece-style BPE whose merge order follows the token scores, with `<0xXX>`
  byte-fallback tokens and an optional "▁" space prefix.
The result encodes like the model's original tokenizer.json; where llama.cpp and transformers'
own GGUF conversion disagree, the comments say which one is followed and why.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers, processors
from tokenizers import Tokenizer as Backend

from engine.errors import TokenizerError
from engine.tokenizer.pretokenize import byte_level_normalizer, byte_level_pre_tokenizer, pre_tokenizer_spec

# llama.cpp's token types (`tokenizer.ggml.token_type`)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space "▁"


@dataclass(frozen=True)
class GGUFTokenizerParts:
    """A backend built from GGUF metadata, with the named special tokens and the chat templates."""

    backend: Backend
    special_tokens: dict[str, str]  # bos_token / eos_token / unk_token / pad_token -> token text
    chat_template: str | dict[str, str] | None


def _fail(source: str, problem: str) -> TokenizerError:
    return TokenizerError(
        f"{source or 'GGUF file'}: {problem}; the file's tokenizer metadata is damaged or from an "
        "unsupported converter: convert the model again with a current llama.cpp"
    )


def _str_list(meta: Mapping[str, Any], key: str, source: str) -> list[str]:
    value = meta.get(key)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _fail(source, f"{key} is missing or not a list of strings")
    return list(value)


def _num_list(meta: Mapping[str, Any], key: str, n: int, source: str) -> list[Any] | None:
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise _fail(source, f"{key} does not hold one value per token ({n})")
    return list(value)


def _token_id(meta: Mapping[str, Any], key: str, n: int, default: int | None, source: str) -> int | None:
    value = meta.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < n:
        # llama.cpp warns and keeps its default for an id outside the vocabulary; so do we
        warnings.warn(f"{source or 'GGUF'}: {key}={value!r} is outside the vocabulary; ignored", stacklevel=4)
        return default if default is not None and 0 <= default < n else None
    return value


def _split_merge(merge: str) -> tuple[str, str]:
    # llama.cpp splits at the first space after position 0, so a left part may itself start with a space
    pos = merge.find(" ", 1)
    if pos < 0:
        raise ValueError(merge)
    return merge[:pos], merge[pos + 1 :]


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges that reproduce llama.cpp's SentencePiece merging: the highest-scoring pair first."""
    ids = {tok: i for i, tok in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    found: list[tuple[float, int, int, int, str, str]] = []
    for tok, i in ids.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ids and right in ids:
                found.append((-scores[i], i, ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _added_tokens(tokens: list[str], types: list[int] | None) -> tuple[list[AddedToken], list[AddedToken]]:
    """Control and unknown tokens become special added tokens; user-defined ones plain added tokens.

    Both are matched whole in the text, as llama.cpp does; only special ones are dropped by
    decode(skip_special_tokens=True).
    """
    special: list[AddedToken] = []
    plain: list[AddedToken] = []
    for i, tok in enumerate(tokens):
        kind = types[i] if types is not None else NORMAL
        if kind in (CONTROL, UNKNOWN):
            special.append(AddedToken(tok, special=True, normalized=False))
        elif kind == USER_DEFINED:
            plain.append(AddedToken(tok, special=False, normalized=False))
    return special, plain


def _post_processor(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None,
                    add_bos: bool, add_eos: bool) -> processors.TemplateProcessing:
    add_bos = add_bos and bos is not None and bos_id is not None
    add_eos = add_eos and eos is not None and eos_id is not None
    single = (f"{bos}:0 " if add_bos else "") + "$A:0" + (f" {eos}:0" if add_eos else "")
    pair = single + (f" {bos}:1" if add_bos else "") + " $B:1" + (f" {eos}:1" if add_eos else "")
    specials = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _byte_level_backend(meta: Mapping[str, Any], tokens: list[str], source: str) -> tuple[Backend, bool]:
    spec = pre_tokenizer_spec(meta.get("tokenizer.ggml.pre"), source)
    merges_raw = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges_raw, (list, tuple)):
        raise _fail(source, "a 'gpt2' vocabulary needs tokenizer.ggml.merges, which is missing")
    try:
        merges = [_split_merge(m) for m in merges_raw]
    except (ValueError, AttributeError) as exc:
        raise _fail(source, f"tokenizer.ggml.merges holds a malformed entry {exc!s:.40}") from exc
    vocab = {tok: i for i, tok in enumerate(tokens)}
    try:
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges)
    except Exception as exc:  # the Rust side rejects merges whose parts are not in the vocabulary
        raise _fail(source, f"the merges do not fit the vocabulary ({exc})") from exc
    backend = Backend(model)
    backend.normalizer = byte_level_normalizer(spec)
    backend.pre_tokenizer = byte_level_pre_tokenizer(spec)
    # Added tokens (like DeepSeek's "<｜begin▁of▁sentence｜>") are stored as raw text, not in the
    # byte alphabet; the ByteLevel decoder passes such a token's own UTF-8 through unchanged.
    backend.decoder = decoders.ByteLevel()
    # `add_space_prefix` is ignored for byte-level vocabularies, as llama.cpp does.
    return backend, spec.add_bos


def _sentencepiece_backend(meta: Mapping[str, Any], tokens: list[str], types: list[int] | None,
                           unk: str | None, source: str) -> Backend:
    n = len(tokens)
    scores = _num_list(meta, "tokenizer.ggml.scores", n, source)
    kinds = types if types is not None else [NORMAL] * n
    merges_raw = meta.get("tokenizer.ggml.merges")
    if isinstance(merges_raw, (list, tuple)) and merges_raw:
        try:  # a converter that kept the tokenizer.json merges
            merges = [_split_merge(m) for m in merges_raw]
        except (ValueError, AttributeError) as exc:
            raise _fail(source, f"tokenizer.ggml.merges holds a malformed entry {exc!s:.40}") from exc
    else:
        if scores is None:
            raise _fail(source, "a 'llama' vocabulary needs tokenizer.ggml.scores or tokenizer.ggml.merges")
        merges = _merges_from_scores(tokens, [float(s) for s in scores], kinds)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    try:
        model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    except Exception as exc:
        raise _fail(source, f"the vocabulary cannot form a BPE model ({exc})") from exc
    backend = Backend(model)
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # A normalizer (not Metaspace's "first" scheme) so that, as in llama.cpp and the legacy Llama
    # tokenizer.json, every stretch of text after a special token gets its own "▁" prefix.
    steps = [normalizers.Prepend(SPACE)] if add_prefix else []
    steps.append(normalizers.Replace(" ", SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    backend.pre_tokenizer = None
    dec = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(dec)
    return backend


def _chat_templates(meta: Mapping[str, Any]) -> str | dict[str, str] | None:
    prefix = "tokenizer.chat_template."
    named = {k[len(prefix):]: v for k, v in meta.items() if k.startswith(prefix) and isinstance(v, str)}
    default = meta.get("tokenizer.chat_template")
    if not named:
        return default if isinstance(default, str) else None
    if isinstance(default, str):
        named["default"] = default
    return named


def build_from_gguf(meta: Mapping[str, Any], source: str = "") -> GGUFTokenizerParts:
    """Build the tokenizer a GGUF file describes; raises TokenizerError for what cannot be built."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise TokenizerError(f"{source or 'GGUF file'}: has no tokenizer (no tokenizer.ggml.model); "
                             "run it with token ids only")
    if kind not in ("gpt2", "llama"):
        raise TokenizerError(
            f"{source or 'GGUF file'}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2' "
            "byte-level BPE and 'llama' SentencePiece BPE); use the model's Hugging Face folder instead"
        )
    tokens = _str_list(meta, "tokenizer.ggml.tokens", source)
    if not tokens:
        raise _fail(source, "tokenizer.ggml.tokens is empty")
    # llama.cpp renames empty tokens so that every token text is unique
    tokens = [tok if tok else f"[EMPTY_{i}]" for i, tok in enumerate(tokens)]
    if len(set(tokens)) != len(tokens):
        raise _fail(source, "tokenizer.ggml.tokens holds the same token twice")
    n = len(tokens)
    types = _num_list(meta, "tokenizer.ggml.token_type", n, source)
    spm = kind == "llama"
    # SentencePiece vocabularies have conventional ids; llama.cpp assumes them when keys are absent
    bos_id = _token_id(meta, "tokenizer.ggml.bos_token_id", n, 1 if spm else None, source)
    eos_id = _token_id(meta, "tokenizer.ggml.eos_token_id", n, 2 if spm else None, source)
    unk_id = _token_id(meta, "tokenizer.ggml.unknown_token_id", n, 0 if spm else None, source)
    pad_id = _token_id(meta, "tokenizer.ggml.padding_token_id", n, None, source)
    named = {"bos_token": bos_id, "eos_token": eos_id, "unk_token": unk_id, "pad_token": pad_id}
    special_tokens = {name: tokens[i] for name, i in named.items() if i is not None}

    if spm:
        backend = _sentencepiece_backend(meta, tokens, types, special_tokens.get("unk_token"), source)
        default_add_bos = True
    else:
        backend, default_add_bos = _byte_level_backend(meta, tokens, source)
    special, plain = _added_tokens(tokens, types)
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)
    if backend.get_vocab_size(with_added_tokens=True) != n:
        raise _fail(source, "the added tokens do not map onto the vocabulary")

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _post_processor(
        special_tokens.get("bos_token"), bos_id, special_tokens.get("eos_token"), eos_id, add_bos, add_eos
    )
    return GGUFTokenizerParts(backend, special_tokens, _chat_templates(meta))
