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
from engine.formats.container import MANIFEST, Container, is_container
from engine.formats.gguf_model import GGUFModel
from engine.formats.hf import SafetensorsFolder, read_json
from engine.models import spec_from_config
from engine.models.transformer import Transformer
from engine.spec import ModelSpec
from engine.tokenizer import Tokenizer
from engine.weights import TensorSource

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


@dataclass
class Checkpoint:
    """A model's files opened but not yet built: config, tensors, tokenizer, generation config."""

    path: Path
    config: dict[str, Any]
    spec: ModelSpec
    source: TensorSource
    tokenizer: Tokenizer | None
    generation: dict[str, Any]

    @property
    def stop_ids(self) -> frozenset[int]:
        """End-of-sequence ids from the config, generation_config.json and the tokenizer."""
        stop = set(self.spec.eos_token_ids) | set(_ids(self.generation.get("eos_token_id")))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            stop.add(self.tokenizer.eos_token_id)
        return frozenset(stop)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a Hugging Face folder, a Colibri container or a GGUF file, checking what can be checked."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelFormatError(f"{path}: no such file or folder; pass a model folder or a .gguf file (or `colibri pull` one)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelFormatError(f"{path}: not a .gguf file; pass a GGUF file or a Hugging Face model folder")
        source: TensorSource = GGUFModel(path)
        config, gen, where = source.config, {}, f"{path} (GGUF metadata)"
        tokenizer = Tokenizer.from_gguf_metadata(source.meta, str(path)) if "tokenizer.ggml.tokens" in source.meta else None
    else:
        if is_container(path):
            source = Container.open(path)
            config, where = source.config, str(path / MANIFEST)
        else:
            config = read_json(path / "config.json", "config.json")
            source, where = SafetensorsFolder(path), str(path / "config.json")
        gen = _generation_config(path)
        tokenizer = Tokenizer.from_folder(path)
    spec = _with_tied_fallback(spec_from_config(config, where), set(source.names()))
    return Checkpoint(path, config, spec, source, tokenizer, gen)


def load_model(path: str | Path, progress: Progress | None = None) -> LoadedModel:
    """Load a Hugging Face folder, a Colibri container or a GGUF file, ready to generate."""
    _report(progress, 0.0, f"reading {Path(path).name}")
    ckpt = open_checkpoint(path)
    _report(progress, 0.1, "loading weights")
    on_layer = lambda i, n: _report(progress, 0.1 + 0.9 * (i + 1) / n, f"layer {i + 1}/{n}")  # noqa: E731
    model = Transformer(ckpt.spec, ckpt.source, on_layer=on_layer)
    if isinstance(ckpt.source, GGUFModel):
        ckpt.source.release()
    gen = ckpt.generation
    defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "do_sample") if k in gen}
    _report(progress, 1.0, "ready")
    return LoadedModel(ckpt.path, ckpt.spec, model, ckpt.tokenizer, ckpt.stop_ids, defaults)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
