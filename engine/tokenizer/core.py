"""The Tokenizer: text <-> token ids and chat prompts, built from a Hugging Face folder or GGUF metadata.

It wraps a `tokenizers.Tokenizer` (the Rust library transformers itself uses) and adds what the
tokenizer files say around it: the named special tokens, the BOS/EOS policy, the chat templates.

Text policy: text that is not valid Unicode is repaired, never refused. Every text `encode` and
`encode_chat` receive (messages, tools and template variables included) goes through `clean_text`,
which turns each lone surrogate and each undecodable byte into one U+FFFD and leaves valid text as is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from engine.tokenizer.chat_template import render_chat, select_template
from engine.tokenizer.detokenize import StreamDecoder
from engine.tokenizer.reasoning import ReasoningFormat, detect_format
from engine.tokenizer.text import clean_text
from engine.tokenizer.tool_calls import ToolFormat, detect_tool_format

# Decoders whose output, past one token of context, is the plain concatenation of each token's text
_WINDOW_SAFE_DECODERS = {"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip", "Sequence"}


def _decoder_types(state: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(state, dict):
        if "type" in state:
            found.add(state["type"])
        for value in state.values():
            found |= _decoder_types(value)
    elif isinstance(state, list):
        for value in state:
            found |= _decoder_types(value)
    return found


def clean_up_tokenization(text: str) -> str:
    """transformers' space cleanup for word-piece vocabularies (" ." -> ".", " n't" -> "n't" ...)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


class Tokenizer:
    """Encodes and decodes text and renders chat prompts for one model."""

    def __init__(self, backend: Backend, special_tokens: Mapping[str, str] | None = None,
                 chat_template: str | Mapping[str, str] | None = None, source: str = "",
                 clean_up_tokenization_spaces: bool = False) -> None:
        self._backend = backend
        self.source = source or "the tokenizer"
        # Named special tokens (bos_token, eos_token, unk_token, pad_token, ...) as text; chat
        # templates see them as variables of the same names.
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._templates = dict(chat_template) if isinstance(chat_template, Mapping) else chat_template
        model_kind = type(backend.model).__name__
        # transformers skips this cleanup for BPE models: it would corrupt their output
        self._clean_up = bool(clean_up_tokenization_spaces) and model_kind != "BPE"
        self.bos_token_id: int | None = self._named_id("bos_token")
        self.eos_token_id: int | None = self._named_id("eos_token")
        self.pad_token_id: int | None = self._named_id("pad_token")
        self.unk_token_id: int | None = self._named_id("unk_token")
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        named_ids = {self._named_id(name) for name in self._special_tokens}
        self.special_ids: frozenset[int] = frozenset(
            {i for i, tok in added.items() if tok.special} | {i for i in named_ids if i is not None}
        )
        self._hold_ids = self._byte_fallback_ids()
        decoder = backend.decoder
        kinds = _decoder_types(json.loads(decoder.__getstate__())) if decoder is not None else set()
        self._windowed = not self._clean_up and kinds <= _WINDOW_SAFE_DECODERS
        self.reasoning_format: ReasoningFormat | None = detect_format(self._templates or None, self.token_to_id)
        self.tool_format: ToolFormat | None = detect_tool_format(self._templates or None)

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer | None:
        """The tokenizer of a Hugging Face model folder; None when the folder has no tokenizer.json."""
        from engine.tokenizer.hf_folder import load_folder

        return load_folder(Path(path), cls)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str = "") -> Tokenizer:
        """The tokenizer a GGUF file describes, from its metadata as plain values."""
        from engine.tokenizer.gguf_vocab import build_from_gguf

        parts = build_from_gguf(meta, source)
        return cls(parts.backend, parts.special_tokens, parts.chat_template, source=source or "GGUF file")

    def save(self, folder: str | Path) -> list[Path]:
        """Write this tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json, chat template)."""
        from engine.tokenizer.hf_folder import save_folder

        return save_folder(self, Path(folder))

    # ---- text <-> ids -----------------------------------------------------------------------

    @property
    def backend(self) -> Backend:
        """The underlying `tokenizers.Tokenizer` (read it, do not change it)."""
        return self._backend

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens as text: bos_token, eos_token, unk_token, pad_token ... (those defined)."""
        return dict(self._special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text` (cleaned: see `clean_text`); special tokens written in the text are recognised."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        return self._backend.encode(clean_text(text), add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text for token ids (ids outside the vocabulary are dropped, as transformers does)."""
        text = self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self._clean_up else text

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of one id (in the vocabulary's own spelling), or None."""
        return self._backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry, or None."""
        return self._backend.token_to_id(token)

    def stream_decoder(self, skip_special_tokens: bool = False, keep_ids: frozenset[int] = frozenset()) -> StreamDecoder:
        """A decoder that turns ids into text one at a time (for streaming generation); with skip_special_tokens,
        the special tokens in `keep_ids` (a reasoning format's markers) still show in the text."""
        invisible = self.special_ids - keep_ids if skip_special_tokens else frozenset()
        if not (skip_special_tokens and keep_ids & self.special_ids):
            return StreamDecoder(lambda ids: self.decode(ids, skip_special_tokens), self._hold_ids, self._windowed,
                                 invisible)
        return StreamDecoder(lambda ids: self.decode([i for i in ids if i not in invisible]), self._hold_ids,
                             self._windowed, invisible)

    # ---- chat -------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template."""
        return bool(self._templates)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for a conversation, as transformers renders it (tools=, documents= and other
        template variables go in `extra`); every string in them is cleaned first (see `clean_text`)."""
        template = select_template(self._templates or None, extra.get("tools") is not None, self.source)
        text = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self._special_tokens, source=self.source, **extra)
        return clean_text(text)  # a template's own literals may come from a damaged file

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """Token ids of the chat prompt: the rendered text encoded without adding BOS/EOS again."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)

    # ---- helpers ----------------------------------------------------------------------------

    def _named_id(self, name: str) -> int | None:
        token = self._special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    def _byte_fallback_ids(self) -> frozenset[int]:
        if not getattr(self._backend.model, "byte_fallback", False):
            return frozenset()
        ids = (self._backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in ids if i is not None)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source}, vocab_size={self.vocab_size})"
