"""A tiny Qwen3-Next (gated DeltaNet layers beside full attention) as a 4-bit container, for the recurrent-state
tests: its kernels are row-invariant, so a token's logits have the same bits however a prompt is split."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from app.hub.convert import ConvertSettings, convert
from engine.kv import KVCache
from support.families import FAMILIES
from support.reference import build_checkpoint

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 140, 31, 77, 2, 120, 56, 11]


def qwen3_next_container(folder: Path) -> Path:
    """Build the shared tiny Qwen3-Next checkpoint under `folder` and convert it to a 4-bit container."""
    model_type, overrides = FAMILIES["qwen3_next"]
    src = build_checkpoint(folder / "src", model_type, **overrides)
    return convert(src, folder / "model", ConvertSettings(bits=4), log=lambda m: None)


def greedy_run(model, tokens: list[int], steps: int, cache: KVCache | None = None) -> tuple[np.ndarray, list[int]]:
    """Prompt logits [T, V] (after what `cache` holds), then `steps` greedy tokens decoded one at a time."""
    cache = cache if cache is not None else KVCache(model.spec, 128)
    logits = model.forward(tokens, cache, all_logits=True)
    out, last = [], logits[-1]
    for _ in range(steps):
        out.append(int(last.argmax()))
        last = model.forward([out[-1]], cache)[-1]
    return logits, out
