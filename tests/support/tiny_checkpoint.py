"""A tiny random Hugging Face checkpoint written with numpy alone (no torch), and its 4-bit container:
the material the damage tests tamper with."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# a Mixtral small enough to write, convert and load in a second or two
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 96, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}


def write_tiny(folder: Path, config: dict | None = None, *, extra: dict[str, np.ndarray] | None = None,
               drop: tuple[str, ...] = (), seed: int = 0) -> Path:
    """Write config.json and a float32 model.safetensors holding every tensor the config implies.

    `extra` adds tensors, `drop` leaves some out (a checkpoint that does not match its config).
    """
    from safetensors.numpy import save_file

    from engine.models import spec_from_config
    from engine.models.transformer import expected_shapes

    config = dict(MIXTRAL if config is None else config)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes = expected_shapes(spec_from_config(config))
    tensors = {n: (rng.standard_normal(s) * 0.1).astype(np.float32) for n, s in shapes.items() if n not in drop}
    tensors.update(extra or {})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def tiny_container(src: Path, out: Path) -> Path:
    """SRC converted to a 4-bit container."""
    from app.hub.convert import ConvertSettings, convert

    return convert(src, out, ConvertSettings(bits=4), log=lambda m: None)


def edit_manifest(container: Path, edit) -> None:
    """Rewrite the container's manifest.json through `edit(manifest) -> manifest` (the hash left as it was)."""
    path = container / "manifest.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
