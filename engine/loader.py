"""Open a model from a path: a Hugging Face folder or a .gguf file -> spec, weights, tokenizer.

Everything is checked before the first token runs (files, config keys, every tensor's shape),
and progress is reported through a callback that can cancel the load.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine.errors import ColibriError, ModelFormatError
from engine.formats.gguf_model import GGUFModel
from engine.formats.hf import SafetensorsFolder, read_json
from engine.models import spec_from_config
from engine.models.transformer import Transformer
from engine.spec import ModelSpec
from engine.tokenizer import Tokenizer

# progress(fraction 0..1, what is happening) -> False to cancel
Progress = Callable[[float, str], "bool | None"]


class LoadCancelled(ColibriError):
    """The progress callback asked to stop loading."""


@dataclass
class LoadedModel:
    """A model ready to generate: its spec, weights, tokenizer and generation defaults."""

    path: Path
    spec: ModelSpec
    model: Transformer
    tokenizer: Tokenizer | None
    stop_ids: frozenset[int]                    # end-of-sequence ids: generation stops on any of them
    defaults: dict[str, Any] = field(default_factory=dict)  # sampling defaults from generation_config.json

    @property
    def name(self) -> str:
        """A short display name."""
        return self.path.name


def _report(progress: Progress | None, fraction: float, message: str) -> None:
    if progress is not None and progress(fraction, message) is False:
        raise LoadCancelled("loading cancelled")


def _generation_config(folder: Path) -> dict[str, Any]:
    path = folder / "generation_config.json"
    return read_json(path, "generation_config.json") if path.is_file() else {}


def _with_tied_fallback(spec: ModelSpec, names: set[str]) -> ModelSpec:
    """Configs that omit tie_word_embeddings and ship no lm_head are tied (as their loaders do)."""
    if not spec.tie_embeddings and "lm_head.weight" not in names:
        return dataclasses.replace(spec, tie_embeddings=True)
    return spec


def load_model(path: str | Path, progress: Progress | None = None) -> LoadedModel:
    """Load a Hugging Face folder or a GGUF file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelFormatError(f"{path}: no such file or folder; pass a model folder or a .gguf file (or `colibri pull` one)")
    _report(progress, 0.0, f"reading {path.name}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelFormatError(f"{path}: not a .gguf file; pass a GGUF file or a Hugging Face model folder")
        source = GGUFModel(path)
        config, gen = source.config, {}
        spec = spec_from_config(config, f"{path} (GGUF metadata)")
        tokenizer = Tokenizer.from_gguf_metadata(source.meta, str(path)) if "tokenizer.ggml.tokens" in source.meta else None
    else:
        cfg_path = path / "config.json"
        config = read_json(cfg_path, "config.json")
        spec = spec_from_config(config, str(cfg_path))
        source = SafetensorsFolder(path)
        gen = _generation_config(path)
        tokenizer = Tokenizer.from_folder(path)
    spec = _with_tied_fallback(spec, set(source.names()))
    _report(progress, 0.1, "loading weights")
    model = Transformer(spec, source, on_layer=lambda i, n: _report(progress, 0.1 + 0.9 * (i + 1) / n, f"layer {i + 1}/{n}"))
    if isinstance(source, GGUFModel):
        source.release()
    stop = set(spec.eos_token_ids) | set(_ids(gen.get("eos_token_id")))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        stop.add(tokenizer.eos_token_id)
    defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "do_sample") if k in gen}
    _report(progress, 1.0, "ready")
    return LoadedModel(path, spec, model, tokenizer, frozenset(stop), defaults)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
