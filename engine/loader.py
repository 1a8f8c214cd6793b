"""Open a model from a path: a Hugging Face folder or a .gguf file -> spec, weights, tokenizer.

Everything is checked before the first token runs (files, config keys, every tensor's shape),
and progress is reported through a callback that can cancel the load.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine.blocks.ffn import StreamingExpertSource
from engine.errors import ColibriError, ModelFormatError
from engine.formats.container import MANIFEST, Container, is_container
from engine.formats.fused import split_fused
from engine.formats.gguf_model import GGUFModel
from engine.formats.hf import SafetensorsFolder, float32_source, read_json
from engine.models import fused_tensors, ignored_tensors, spec_from_config
from engine.models.transformer import Transformer, expected_shapes
from engine.spec import ModelSpec
from engine.telemetry import NULL, Telemetry
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
    store: Any = None                           # the ExpertStore (MoE) or LayerStore (dense) streaming weights, if any
    history_path: Path | None = None            # where the usage history is saved on close

    @property
    def name(self) -> str:
        """A short display name."""
        return self.path.name

    def close(self) -> None:
        """Save the usage history (atomically) and stop the store's readers; idempotent."""
        store, self.store = self.store, None
        if store is None:
            return
        try:
            if store.history is not None and self.history_path is not None:
                if isinstance(store, StreamingExpertSource):
                    store.learn_policy()        # the cache's half-life that served this session best
                store.history.save(self.history_path)
        finally:
            store.close()


@dataclass(frozen=True)
class OffloadOptions:
    """Stream routed experts from a container instead of holding them all (engine.offload)."""

    store: Any                                  # engine.offload.store.StoreSettings
    prefetch_depth: int = 1                     # layers read ahead (MoE: by lookahead routing; 0: off)
    history_path: Path | None = None            # the usage-history sidecar (None: no learning)
    resident_layers: int = 0                    # dense models: the first layers held, the others streamed


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


def open_checkpoint(path: str | Path, verify_experts: bool = True, verify: bool = True,
                    quantized: bool = False, huge_pages: bool = False) -> Checkpoint:
    """Open a Hugging Face folder, a Colibri container or a GGUF file, checking what can be checked.

    verify_experts=False leaves a container's expert extents unread (a streaming store checks each on its first read).
    quantized=True loads a GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 matrices as QuantizedTensors, and a folder's published
    FP8 / MXFP4 weights as FP8Tensor / MXFP4Tensor (to run them), else every tensor reads as float32 (to convert
    or analyse them).
    huge_pages=True maps a container's files on 2 MB pages (a model about to be held whole: Container.open).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelFormatError(f"{path}: no such file or folder; pass a model folder or a .gguf file (or `colibri pull` one)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelFormatError(f"{path}: not a .gguf file; pass a GGUF file or a Hugging Face model folder")
        source: TensorSource = GGUFModel(path, quantized=quantized)
        config, gen, where = source.config, {}, f"{path} (GGUF metadata)"
        tokenizer = Tokenizer.from_gguf_metadata(source.meta, str(path)) if "tokenizer.ggml.tokens" in source.meta else None
    else:
        if is_container(path):
            source = Container.open(path, verify=verify, verify_experts=verify_experts, huge_pages=huge_pages)
            config, where = source.config, str(path / MANIFEST)
        else:
            config = read_json(path / "config.json", "config.json")
            source, where = SafetensorsFolder(path), str(path / "config.json")
        gen = _generation_config(path)
        tokenizer = Tokenizer.from_folder(path)
    spec = spec_from_config(config, where)
    source = split_fused(source, fused_tensors(config, where))   # fused experts -> per-expert tensors
    if not quantized:
        source = float32_source(source)                          # published FP8 / MXFP4 weights, dequantized
    names = set(source.names())
    spec = _with_tied_fallback(spec, names)
    check_tensor_names(spec, names, config, where, source)
    return Checkpoint(path, config, spec, source, tokenizer, gen)


def _listed(names: list[str]) -> str:
    """The first few names and how many more."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_tensor_names(spec: ModelSpec, names: set[str], config: dict[str, Any], where: str,
                       source: TensorSource) -> None:
    """Refuse a checkpoint that lacks a tensor its spec needs, or carries one nothing reads (but its family's
    allow-list): either way the weights and the config disagree, and running would give wrong text, silently."""
    expected = expected_shapes(spec)
    missing = sorted(n for n in expected if n not in names)
    if missing:
        raise ModelFormatError(
            f"{source.path}: {len(missing)} tensor(s) the config implies are missing: {_listed(missing)}; "
            "the weights do not match the config (or the download is incomplete): fetch the model again"
        )
    allowed = ignored_tensors(config, where)
    # tied: the head is the embedding, and a checkpoint may still save a copy of it
    unused = sorted(n for n in names - expected.keys()
                    if not allowed.fullmatch(n) and not (n == "lm_head.weight" and spec.tie_embeddings))
    if isinstance(source, GGUFModel):
        unused += source.unmapped                   # its tensors that have no Hugging Face name
    if unused:
        raise ModelFormatError(
            f"{source.path}: {len(unused)} tensor(s) the model does not use: {_listed(unused)}; the weights do not "
            f"match the config ({spec.n_layers} layers, {spec.architecture}): use the config that came with them, "
            "or fetch the model again"
        )


def load_model(path: str | Path, progress: Progress | None = None, offload: OffloadOptions | None = None,
               telemetry: Telemetry = NULL) -> LoadedModel:
    """Load a Hugging Face folder, a Colibri container or a GGUF file, ready to generate.

    With `offload`, routed experts stay on disk and an ExpertStore brings them in under its byte budget
    (a container is needed: its experts lie in aligned extents, one read each).
    """
    _report(progress, 0.0, f"reading {Path(path).name}")
    ckpt = open_checkpoint(path, verify_experts=offload is None, verify=offload is None, quantized=True,
                           huge_pages=offload is None)
    store, layers, history_path = None, None, None
    if offload is not None:
        # what is held is checked now; streamed experts or layers when the store first reads them, so that
        # opening a model larger than memory does not read all of it
        if _is_moe(ckpt.spec):
            _need_container(ckpt)
            ckpt.source.advise_huge_pages(experts=False)     # the dense part, held (before verify reads it)
            ckpt.source.verify(experts=False)
            store = _open_store(ckpt, offload, telemetry)
            history_path = offload.history_path
        else:
            _need_container(ckpt)
            held = [n for n in ckpt.source.names() if not _streamed_layer(n, offload.resident_layers)]
            ckpt.source.verify(names=held)
            layers = _open_layers(ckpt, offload, telemetry)
            store = layers
    _report(progress, 0.1, "loading weights")
    on_layer = lambda i, n: _report(progress, 0.1 + 0.9 * (i + 1) / n, f"layer {i + 1}/{n}")  # noqa: E731
    try:
        model = Transformer(ckpt.spec, ckpt.source, experts=None if layers is not None else store, on_layer=on_layer,
                            telemetry=telemetry, prefetch_depth=offload.prefetch_depth if offload is not None else 0,
                            layers=layers)
    except BaseException:
        if store is not None:
            store.close()
        raise
    if isinstance(ckpt.source, GGUFModel):
        ckpt.source.release()
    gen = ckpt.generation
    defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "do_sample") if k in gen}
    _report(progress, 1.0, "ready")
    return LoadedModel(ckpt.path, ckpt.spec, model, ckpt.tokenizer, ckpt.stop_ids, defaults, store, history_path)


def _is_moe(spec: ModelSpec) -> bool:
    from engine.spec import MoESpec

    return any(isinstance(layer.ffn, MoESpec) for layer in spec.layers)


def _streamed_layer(name: str, resident_layers: int) -> bool:
    """Whether tensor `name` belongs to a decoder layer at or past `resident_layers`."""
    parts = name.split(".")
    return len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and int(parts[2]) >= resident_layers


def _need_container(ckpt: Checkpoint) -> None:
    if not isinstance(ckpt.source, Container):
        raise ColibriError(f"{ckpt.path}: streaming needs a Colibri container (weights laid out for reading in pieces); "
                           f"convert it first: `colibri convert {ckpt.path} OUT --bits 4`")


def _open_layers(ckpt: Checkpoint, offload: OffloadOptions, telemetry: Telemetry):
    """The layer store of a dense model: the first layers held, the others read ahead while earlier ones compute."""
    from engine.offload.layers import LayerStore

    _need_container(ckpt)
    s = offload.store
    return LayerStore(ckpt.source, ckpt.spec, offload.resident_layers, offload.prefetch_depth, io_threads=s.io_threads,
                      telemetry=telemetry, direct=s.direct, io=s.io)


def _open_store(ckpt: Checkpoint, offload: OffloadOptions, telemetry: Telemetry):
    """The expert store over a container, with the usage history when one is kept."""
    from engine.offload.history import UsageHistory
    from engine.offload.store import ExpertStore
    from engine.spec import MoESpec

    _need_container(ckpt)
    moe = [layer.ffn for layer in ckpt.spec.layers if isinstance(layer.ffn, MoESpec)]
    history = None
    if offload.history_path is not None:
        history = UsageHistory.load_or_new(offload.history_path, ckpt.source.model_hash, ckpt.spec.n_layers,
                                           max(m.n_experts for m in moe))
    return ExpertStore(ckpt.source, ckpt.spec, offload.store, history, telemetry)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def load_mtp(path: str | Path, spec: ModelSpec):
    """The MTP drafter's head (`engine.generation.mtp.MTPHead`) of the checkpoint at `path`, whose main model has
    `spec`; NoMTPError when it has no MTP layers. Its tensors are mapped, not verified (the main model's were)."""
    from engine.generation.mtp import mtp_head

    ckpt = open_checkpoint(path, verify_experts=False, verify=False, quantized=True)
    return mtp_head(ckpt.config, ckpt.source, spec, str(ckpt.path))
