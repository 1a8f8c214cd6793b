"""Read a Hugging Face tokenizer folder: tokenizer.json, tokenizer_config.json, special_tokens_map.json
and the chat templates (chat_template.jinja, additional_chat_templates/*.jinja or the config's entry).

tokenizer.json is the tokenizer: its normalizer, pre-tokenizer, model, post-processor (which adds
BOS/EOS) and decoder are used as written, as transformers does when it loads the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from engine.errors import TokenizerError

if TYPE_CHECKING:
    from engine.tokenizer.core import Tokenizer

NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot be read ({exc}); check the file or download the model again") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenizerError(
            f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            "the file is damaged: download the model's tokenizer files again"
        ) from exc


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot be read ({exc}); check the file or download the model again") from exc


def _token_text(value: Any) -> str | None:
    """A special token as the config spells it: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(value: Any, special: bool) -> AddedToken | None:
    if isinstance(value, str):
        return AddedToken(value, special=special, normalized=not special)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return AddedToken(
            value["content"], single_word=bool(value.get("single_word", False)),
            lstrip=bool(value.get("lstrip", False)), rstrip=bool(value.get("rstrip", False)),
            normalized=bool(value.get("normalized", not special)), special=bool(value.get("special", special)),
        )
    return None


def _load_backend(path: Path) -> Backend:
    data = _read_json(path)
    if not isinstance(data, dict) or "model" not in data:
        raise TokenizerError(f"{path}: not a tokenizer.json (no 'model' entry); download the tokenizer files again")
    try:
        backend = Backend.from_str(json.dumps(data))
    except Exception as exc:  # the Rust parser's errors come as plain Exception
        raise TokenizerError(
            f"{path}: the tokenizers library cannot load it ({exc}); the file may be damaged or need a "
            "newer `tokenizers` package: download it again or upgrade tokenizers"
        ) from exc
    # An inference engine must never cut or pad a prompt behind the user's back
    backend.no_truncation()
    backend.no_padding()
    return backend


def _chat_templates(folder: Path, config: dict) -> tuple[str | dict[str, str] | None, str]:
    """The folder's chat template(s) and the file they came from, in transformers' order of priority."""
    templates: dict[str, str] = {}
    source = ""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = _read_text(jinja_file)
        source = str(jinja_file)
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = _read_text(file)
            source = source or str(extra_dir)
    if templates:
        if list(templates) == ["default"]:
            return templates["default"], source
        return templates, source
    entry = config.get("chat_template")
    config_file = str(folder / "tokenizer_config.json")
    if isinstance(entry, str):
        return entry, config_file
    if isinstance(entry, list):  # [{"name": ..., "template": ...}, ...]
        named = {t["name"]: t["template"] for t in entry
                 if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        return (named or None), config_file
    return None, config_file


def load_folder(folder: Path, cls: type[Tokenizer]) -> Tokenizer | None:
    """Build cls (a Tokenizer) from a Hugging Face folder; None when it has no tokenizer.json."""
    if not folder.is_dir():
        raise TokenizerError(f"{folder}: no such model folder; check the path")
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    backend = _load_backend(tokenizer_file)
    config_file = folder / "tokenizer_config.json"
    config = _read_json(config_file) if config_file.is_file() else {}
    if not isinstance(config, dict):
        raise TokenizerError(f"{config_file}: expected a JSON object; download the tokenizer files again")

    named: dict[str, Any] = {k: config[k] for k in NAMED_TOKENS if k in config}
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    map_file = folder / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and map_file.is_file():
        # Legacy folders keep the special tokens here; transformers lets this file win over the config
        token_map = _read_json(map_file)
        if isinstance(token_map, dict):
            named.update({k: token_map[k] for k in NAMED_TOKENS if k in token_map})
            extra = extra or token_map.get("additional_special_tokens") or []

    # Tokens the config declares but tokenizer.json lacks are added, as transformers does
    vocab = backend.get_vocab(with_added_tokens=True)
    declared = config.get("added_tokens_decoder")
    declared_values = [v for _, v in sorted(declared.items(), key=lambda kv: int(kv[0]))] \
        if isinstance(declared, dict) else []
    extras = list(extra.values()) if isinstance(extra, dict) else list(extra) if isinstance(extra, list) else []
    candidates = [_added_token(v, special=False) for v in declared_values]
    candidates += [_added_token(v, special=True) for v in [*named.values(), *extras]]
    for token in candidates:
        if token is not None and token.content not in vocab:
            (backend.add_special_tokens if token.special else backend.add_tokens)([token])
            vocab[token.content] = backend.token_to_id(token.content)

    if config.get("split_special_tokens"):
        backend.encode_special_tokens = True
    templates, template_source = _chat_templates(folder, config)
    special = {k: t for k, t in ((k, _token_text(v)) for k, v in named.items()) if t is not None}
    return cls(
        backend,
        special,
        templates,
        source=template_source if templates else str(folder),
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
    )


def save_folder(tokenizer: "Tokenizer", folder: Path) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and the chat template(s) so `load_folder` reads the
    same tokenizer back (used to give a GGUF's tokenizer to a Hugging Face-style folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / "tokenizer.json", folder / "tokenizer_config.json"]
    tokenizer.backend.save(str(written[0]))
    config: dict[str, Any] = dict(tokenizer.special_tokens)
    config["clean_up_tokenization_spaces"] = False
    templates = tokenizer._templates
    if isinstance(templates, str):
        (folder / "chat_template.jinja").write_text(templates, encoding="utf-8")
        written.append(folder / "chat_template.jinja")
    elif templates:
        config["chat_template"] = [{"name": n, "template": t} for n, t in templates.items()]
    written[1].write_text(json.dumps(config, indent=1, ensure_ascii=False), encoding="utf-8")
    return written
