"""Hugging Face folders: config.json, (sharded) safetensors, generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from engine.errors import ModelFormatError
from engine.formats.fused import SplitSource
from engine.formats.published import PublishedTensors, read_quantization
from engine.formats.safetensors_file import SafetensorsFile


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from a file, or a ModelFormatError that names the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: {what} is missing; a Hugging Face model folder needs it") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: {what} is not valid JSON ({exc}); fetch the model again") from None
    except RecursionError:   # nested thousands deep: no config a tool writes
        raise ModelFormatError(f"{path}: {what} is nested too deeply to be read; fetch the model again") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: {what} should hold a JSON object")
    return data


class SafetensorsFolder:
    """All tensors of a folder's model.safetensors, or of the shards its index lists.

    Weights its publisher quantized (block-scaled FP8, MXFP4: engine/formats/published.py) show under the
    unquantized weight's name and load as FP8Tensor / MXFP4Tensor over the map, their scales hidden.
    """

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self.path = str(folder)
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        if index.is_file():
            weight_map = read_json(index, "the safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ModelFormatError(f"{index}: no 'weight_map' object of tensor -> file name; fetch the model again")
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (folder / f).is_file()]
            if missing:
                raise ModelFormatError(f"{folder}: shard(s) {', '.join(missing)} listed in {index.name} are missing; "
                                       "the download is incomplete: fetch the model again")
        elif single.is_file():
            files = [single.name]
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            if not files:
                raise ModelFormatError(f"{folder}: no model.safetensors (nor shards with model.safetensors.index.json); "
                                       "this folder holds no weights Colibri can read")
        self.files = {f: SafetensorsFile(folder / f) for f in files}
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files.values():
            for name in f.tensors:
                self._where[name] = f
        if index.is_file():
            lost = [n for n, f in weight_map.items() if n not in self._where]
            if lost:
                raise ModelFormatError(f"{index}: tensor {lost[0]} is listed but not in {weight_map[lost[0]]}; fetch the model again")
        config = folder / "config.json"
        quant = read_quantization(read_json(config, "config.json") if config.is_file() else None, str(config))
        self.published = PublishedTensors(self, quant)

    def stored_names(self) -> Iterable[str]:
        """Every tensor stored in the folder's files (FP8 scales and MXFP4 blocks and scales included)."""
        return self._where.keys()

    def stored_shape(self, name: str) -> tuple[int, ...]:
        """A stored tensor's shape (an MXFP4 pair's `_blocks` or `_scales`, not the shape shown for the pair)."""
        return self._where[name].tensors[name][1]

    def names(self) -> Iterable[str]:
        """Every tensor name the folder shows: the stored ones, an FP8 scale or an MXFP4 pair as the weight's name."""
        hidden = self.published.hidden
        return [n for n in self._where if n not in hidden] + list(self.published.mxfp4)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape."""
        shown = self.published.shape(name)
        return shown if shown is not None else self.stored_shape(name)

    def dtype(self, name: str) -> str:
        """A tensor's stored dtype (safetensors spelling)."""
        return self._where[name].tensors[name][0]

    def raw(self, name: str) -> np.ndarray:
        """A tensor's stored values (bf16 as uint16), a read-only view of its file's map."""
        return self._where[name].raw(name)

    def load(self, name: str):
        """A tensor as float32 (a memory-mapped view when stored as F32), an FP8 weight as an FP8Tensor."""
        if name in self.published.fp8:
            return self.published.fp8_tensor(name)
        if name in self.published.mxfp4:
            raise ModelFormatError(f"{self.location(name)}: MXFP4 tensor {name} is read in pieces (one per expert) "
                                   "through its family's fused-tensor rules, not whole")
        return self._where[name].float32(name)

    def drop_pages(self, name: str) -> None:
        """Give back the mapped pages of a tensor read once (see SafetensorsFile.drop_pages)."""
        if name in self._where:                  # an MXFP4 pair's fused name is not a stored tensor
            self._where[name].drop_pages(name)

    def packed(self, name: str):
        """The MXFP4 pair shown as `name` (an engine.formats.published.MXFP4Stack), None for other names."""
        return self.published.packed(name)

    def location(self, name: str) -> str:
        """The file holding a tensor."""
        f = self._where.get(name) or self._where.get(name + "_blocks")
        return str(f.path) if f else self.path


class Float32Source:
    """A source over a folder with published FP8 / MXFP4 weights that reads every tensor as float32 (one matrix
    dequantized at a time): what conversion and analysis read, as a GGUF opened unquantized."""

    def __init__(self, source):
        self.base = source
        self.path = source.path

    def names(self) -> Iterable[str]:
        """The base's tensor names."""
        return self.base.names()

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape."""
        return self.base.shape(name)

    def load(self, name: str) -> np.ndarray:
        """The tensor as float32: an FP8 or MXFP4 weight dequantized (a new array), others as the base reads them."""
        w = self.base.load(name)
        return w if isinstance(w, np.ndarray) else w.dequantize()

    def location(self, name: str) -> str:
        """The file holding a tensor."""
        return self.base.location(name)

    def published(self, name: str):
        """The tensor as published when it is an FP8 or MXFP4 weight (FP8Tensor / MXFP4Tensor), else None."""
        w = self.base.load(name)
        return None if isinstance(w, np.ndarray) else w


def float32_source(source):
    """`source`, or a Float32Source over it when its folder (under any fused-tensor split) holds published FP8 or
    MXFP4 weights."""
    folder = source.base if isinstance(source, SplitSource) else source
    if isinstance(folder, SafetensorsFolder) and (folder.published.fp8 or folder.published.mxfp4):
        return Float32Source(source)
    return source
