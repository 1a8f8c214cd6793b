"""What Ollama's `details` tell of a model: its parameter count and quantization, read from the model's own files
(a container's manifest, a GGUF's metadata, a Hugging Face folder's config and safetensors headers), in Ollama's
spelling ("135M", "1.7B"; "Q4_K_M", "4-bit", "BF16")."""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from pathlib import Path

from app.library import GGUF, HUGGING_FACE, describe
from engine.errors import ColibriError

_PUBLISHED = {"colibri.fp8": "FP8", "colibri.mxfp4": "MXFP4", "colibri.kquant": "K-quant"}


def parameter_size(count: int | None) -> str:
    """A parameter count as Ollama shows it: "135M", "1.7B", "12K" ("" when not known)."""
    if not count:
        return ""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            value = count / scale
            text = f"{value:.0f}" if value >= 100 else f"{value:.1f}".removesuffix(".0")
            return text + unit
    return str(count)


def model_details(path: Path) -> tuple[str, str]:
    """(parameter size, quantization level) of the model at `path`; a part that cannot be read is ""."""
    try:
        entry = describe(path, path.parent)
    except (OSError, ValueError, ColibriError):
        return "", ""
    try:
        if entry.kind == GGUF:
            quant = _gguf_quantization(path)
        elif entry.kind == HUGGING_FACE:
            quant = _hf_quantization(path)
        else:
            quant = _container_quantization(path)
    except (OSError, ValueError, KeyError, TypeError, struct.error, ColibriError):
        quant = ""
    return parameter_size(entry.params), quant


def _gguf_quantization(path: Path) -> str:
    """The GGUF's file type (general.file_type: "Q4_K_M"), else the type holding the most weights."""
    import gguf

    from engine.formats.gguf_meta import gguf_metadata, open_gguf

    reader = open_gguf(path)
    file_type = gguf_metadata(reader).get("general.file_type")
    if file_type is not None:
        try:
            return gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    weights: Counter[str] = Counter()
    for t in reader.tensors:
        weights[t.tensor_type.name] += int(t.n_elements)
    return weights.most_common(1)[0][0] if weights else ""


def _container_quantization(path: Path) -> str:
    """The matrices' bit width ("4-bit"; "2-8-bit" when the plan mixed widths), or their published or plain type."""
    tensors = json.loads((path / "manifest.json").read_text(encoding="utf-8"))["tensors"]
    labels: Counter[str] = Counter()
    bits: set[int] = set()
    for e in tensors.values():
        q = e.get("quant")
        if isinstance(q, dict) and q.get("kind") in _PUBLISHED:
            label = str(q.get("type")) if q["kind"] == "colibri.kquant" else _PUBLISHED[q["kind"]]   # Q4_K ...
        elif isinstance(q, dict):
            bits.add(int(q["bits"]))
            label = "bits"
        else:
            label = str(e["kind"]).upper()
        labels[label] += math.prod(e["shape"])
    if not labels:
        return ""
    top = labels.most_common(1)[0][0]
    if top != "bits":
        return top
    return f"{min(bits)}-bit" if len(bits) == 1 else f"{min(bits)}-{max(bits)}-bit"


def _hf_quantization(path: Path) -> str:
    """The checkpoint's published quantization (`quantization_config`: "FP8"), else the dtype of most weights."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method:
        return str(method).upper()
    dtypes: Counter[str] = Counter()
    for shard in sorted(path.glob("*.safetensors")):
        with open(shard, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for key, t in header.items():
            if key != "__metadata__":
                dtypes[str(t["dtype"])] += math.prod(t["shape"])
    return dtypes.most_common(1)[0][0] if dtypes else ""
