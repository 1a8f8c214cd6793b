"""`colibri atlas`: which experts of an MoE the probe topics use, saved as a sidecar bound to the model.

Each probe prompt is read as plain text (no chat template, whose markers every topic would share)
and every MoE layer's routing is counted per expert, topic and half of the prompts (even / odd,
for the split-half check). `app.atlas.stats` turns the counts into the atlas. The sidecar (JSON,
written atomically) carries the model hash and is refused for any other model.

The model hash (`colibri-sample-v1`) is sha256 over config.json's bytes (for a folder) and, for
every weight file (`*.safetensors` of a folder, or the .gguf itself), its name, its size and 16
blocks of 64 KiB spread evenly from its first to its last byte: quick on multi-GB files, and any
re-download, conversion or edit of a model changes it in practice.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np

from app.atlas.probes import ProbeTopic, load_probes
from app.atlas.stats import PROJECTION, expert_stats, explained_variance, text_report
from engine.blocks.ffn import Routing
from engine.errors import ColibriError
from engine.kv import KVCache
from engine.loader import LoadedModel, load_model
from engine.spec import MoESpec

FORMAT = "colibri-atlas"
VERSION = 1
HASH_SCHEME = "colibri-sample-v1"
_BLOCKS, _BLOCK = 16, 64 * 1024

# progress(fraction 0..1, what is happening) -> False to cancel (as engine.loader's)
Progress = Callable[[float, str], "bool | None"]


class AtlasCancelled(ColibriError):
    """The progress callback asked to stop."""


class AtlasMismatch(ColibriError):
    """A sidecar that belongs to another model."""


def model_hash(path: str | Path) -> str:
    """The model's identity for sidecars: sha256 of config.json and sampled bytes of its weight files."""
    path = Path(path)
    if path.is_dir() and (path / "manifest.json").is_file():    # a Colibri container carries its hash
        from engine.formats.container import Container

        return Container.open(path, verify=False).model_hash
    digest = hashlib.sha256(HASH_SCHEME.encode())
    if path.is_dir():
        config = path / "config.json"
        digest.update(config.read_bytes() if config.is_file() else b"")
        weights = sorted(path.glob("*.safetensors"))
    else:
        weights = [path]
    if not weights or not all(w.is_file() for w in weights):
        raise ColibriError(f"{path}: no weight files to identify the model by; pass a model folder or a .gguf file")
    for file in weights:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as handle:
            for k in range(_BLOCKS):
                handle.seek((size - _BLOCK) * k // (_BLOCKS - 1) if size > _BLOCK else 0)
                digest.update(handle.read(_BLOCK))
    return digest.hexdigest()


def default_sidecar(model_path: str | Path) -> Path:
    """Where a model's atlas lives unless told: `atlas.json` in its folder, or `<file>.atlas.json` beside a GGUF."""
    path = Path(model_path)
    return path / "atlas.json" if path.is_dir() else path.with_name(path.name + ".atlas.json")


def read_atlas(sidecar: str | Path, model_path: str | Path) -> dict[str, Any]:
    """The atlas in SIDECAR, refused unless it was made for the model at MODEL_PATH."""
    sidecar = Path(sidecar)
    try:
        data = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ColibriError(f"{sidecar}: not a readable atlas ({exc}); run `colibri atlas MODEL` again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ColibriError(f"{sidecar}: not a Colibri atlas file")
    if data.get("version") != VERSION:
        raise ColibriError(f"{sidecar}: atlas version {data.get('version')} is not {VERSION}; run `colibri atlas` again")
    check_binding(data, sidecar, model_path)
    return data


def check_binding(data: dict[str, Any], sidecar: Path, model_path: str | Path) -> None:
    """Raise AtlasMismatch unless the atlas DATA was made for the model at MODEL_PATH."""
    mine = model_hash(model_path)
    if data.get("model_hash") != mine or data.get("hash_scheme") != HASH_SCHEME:
        raise AtlasMismatch(
            f"{sidecar} belongs to another model (hash {str(data.get('model_hash'))[:12]}..., made for "
            f"{data.get('model', '?')}), not to {model_path} (hash {mine[:12]}...): run `colibri atlas "
            f"{model_path}` to make this model's atlas, with --out elsewhere to keep the other one"
        )


def route_probes(loaded: LoadedModel, topics: list[ProbeTopic], progress: Progress | None = None,
                 start: float = 0.0, span: float = 1.0) -> tuple[dict[int, np.ndarray], np.ndarray]:
    """Routing counts {layer: [E, topics, 2]} and routed tokens [topics, 2] of the probes (position 0 skipped)."""
    moe_layers = {i: layer.ffn.n_experts for i, layer in enumerate(loaded.spec.layers) if isinstance(layer.ffn, MoESpec)}
    if not moe_layers:
        raise ColibriError(f"{loaded.name} is a dense model ({loaded.spec.architecture}): it has no experts to map; "
                           "an atlas needs a Mixture-of-Experts model")
    if loaded.tokenizer is None:
        raise ColibriError(f"{loaded.name} has no tokenizer; the atlas reads text prompts")
    counts = {i: np.zeros((e, len(topics), 2), np.int64) for i, e in moe_layers.items()}
    tokens = np.zeros((len(topics), 2), np.int64)
    total, done = sum(len(t.prompts) for t in topics), 0
    for t, topic in enumerate(topics):
        for j, prompt in enumerate(topic.prompts):
            ids = loaded.tokenizer.encode(prompt)
            if len(ids) < 2:
                continue
            routing: list[Routing] = []
            loaded.model.forward(ids, KVCache(loaded.spec, len(ids) + 1), routing=routing)
            for r in routing:  # row 0 is the attention sink, whose routing says nothing of the topic
                counts[r.layer][:, t, j % 2] += np.bincount(r.experts[1:].reshape(-1), minlength=moe_layers[r.layer])
            tokens[t, j % 2] += len(ids) - 1
            done += 1
            _report(progress, start + span * done / total, f"probes: {topic.topic} {j + 1}/{len(topic.prompts)}")
    return counts, tokens


def build_atlas(model_path: Path, topics: list[ProbeTopic], counts: dict[int, np.ndarray], tokens: np.ndarray,
                model_id: str, probes: str) -> dict[str, Any]:
    """The sidecar's content from routing counts."""
    names = [t.topic for t in topics]
    by_layer: dict[int, list[dict[str, Any]]] = {}
    stats = expert_stats(counts, tokens)
    shares = explained_variance(np.array([s.distribution for s in stats]).reshape(len(stats), len(topics)))
    for s in stats:
        by_layer.setdefault(s.layer, []).append({
            "expert": s.expert, "selections": s.selections, "topic_counts": list(s.topic_counts),
            "topic_distribution": [round(p, 6) for p in s.distribution],
            "specialisation": round(s.specialisation, 6),
            "top_topic": names[s.top_topic] if s.top_topic is not None else None,
            "reproduces": s.reproduces, "position": [round(x, 6) for x in s.position],
        })
    return {
        "format": FORMAT, "version": VERSION, "hash_scheme": HASH_SCHEME, "model_hash": model_id,
        "model": str(model_path), "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "probes": {"source": probes, "topics": [
            {"topic": t.topic, "title": t.title, "prompts": len(t.prompts), "tokens": [int(x) for x in tokens[n]]}
            for n, t in enumerate(topics)]},
        "statistics": {
            "topic_distribution": "selection rate per topic (selections / the topic's routed tokens), normalised",
            "specialisation": "1 - entropy(topic_distribution) / log(topics)",
            "reproduces": "the top topic of the even-numbered prompts equals that of the odd-numbered ones",
            "position": PROJECTION,
            "explained_variance": "each position axis's share of the squared distances' spread (PCA variance)",
        },
        "explained_variance": [round(float(v), 6) for v in shares],
        "layers": [{"layer": layer, "experts": experts} for layer, experts in sorted(by_layer.items())],
    }


def run_atlas(model: str | Path, out: str | Path | None = None, probes: str | Path | None = None,
              progress: Progress | None = None) -> tuple[Path, dict[str, Any]]:
    """Route the probes through MODEL and write its atlas sidecar; return (sidecar path, atlas)."""
    model = Path(model)
    sidecar = Path(out) if out is not None else default_sidecar(model)
    model_id = model_hash(model)
    if sidecar.is_file():  # never overwrite another model's atlas
        try:
            existing = json.loads(sidecar.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            existing = None
        if not isinstance(existing, dict) or existing.get("format") != FORMAT:
            raise ColibriError(f"{sidecar} exists and is no Colibri atlas; choose another --out")
        check_binding(existing, sidecar, model)
    topics = load_probes(Path(probes) if probes is not None else None)
    _report(progress, 0.0, f"loading {model.name}")
    loaded = load_model(model, lambda f, m: _report(progress, 0.2 * f, f"loading {model.name}: {m}"))
    counts, tokens = route_probes(loaded, topics, progress, 0.2, 0.75)
    atlas = build_atlas(model, topics, counts, tokens, model_id, str(probes) if probes is not None else "assets/probes")
    write_atomic(sidecar, atlas)
    _report(progress, 1.0, "done")
    return sidecar, atlas


def report_text(atlas: dict[str, Any]) -> str:
    """The short text report of an atlas: most specialised experts per topic, share that reproduces."""
    from app.atlas.stats import ExpertStats

    names = [t["topic"] for t in atlas["probes"]["topics"]]
    stats = [ExpertStats(layer["layer"], x["expert"], x["selections"], tuple(x["topic_counts"]),
                         tuple(x["topic_distribution"]), x["specialisation"],
                         names.index(x["top_topic"]) if x["top_topic"] is not None else None,
                         x["reproduces"], tuple(x["position"]))
             for layer in atlas["layers"] for x in layer["experts"]]
    n_tokens = sum(sum(t["tokens"]) for t in atlas["probes"]["topics"])
    head = (f"atlas of {Path(atlas['model']).name}: {len(atlas['layers'])} MoE layers, {len(stats)} experts, "
            f"{len(names)} topics, {n_tokens} probe tokens")
    return head + "\n" + text_report(stats, names) + f"\npositions: {atlas['statistics']['position']}"


def write_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write the atlas as JSON, atomically; a full disk raises DiskFullError and keeps the previous file."""
    from engine.atomic import atomic_file
    from engine.errors import DiskFullError, is_disk_full

    try:
        with atomic_file(path) as handle:
            json.dump(data, handle, indent=1, ensure_ascii=False)
            handle.write("\n")
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFullError(f"disk full: the atlas {path} was not written (a previous one is kept); free space "
                                "or choose another --out, and build it again") from None
        raise


def _report(progress: Progress | None, fraction: float, message: str) -> None:
    if progress is not None and progress(min(fraction, 1.0), message) is False:
        raise AtlasCancelled("atlas cancelled; nothing was written")
