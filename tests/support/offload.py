"""What the streaming tests share: a small Mixtral container, a load of it streamed through a cache of so many
expert slots, and a prompt's logits and greedy continuation to compare bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from app.hub.convert import ConvertSettings, convert
from engine.kv import KVCache
from engine.loader import OffloadOptions, load_model
from engine.offload.store import StoreSettings
from support.reference import build_checkpoint


def mixtral_container(tmp_path_factory, experts: int, top_k: int, layers: int) -> Path:
    """A tiny random Mixtral of `layers` layers, `experts` experts (top_k chosen), converted to 4 bits."""
    src = build_checkpoint(tmp_path_factory.mktemp("src"), "mixtral", num_local_experts=experts,
                           num_experts_per_tok=top_k, num_hidden_layers=layers)
    return convert(src, tmp_path_factory.mktemp("c") / "moe", ConvertSettings(bits=4), log=lambda m: None)


def slot_bytes(container: Path) -> int:
    """Bytes of one expert slot when `container` streams (from a load of it, closed at once)."""
    probe = load_model(container, offload=OffloadOptions(StoreSettings(capacity=1 << 30)))
    try:
        return probe.store.slot_bytes
    finally:
        probe.close()


def load_streamed(container: Path, slots: int, prefetch_depth: int = 1, **settings):
    """`container` with its experts streamed through a cache of `slots` slots (StoreSettings' other fields from
    `settings`), reading `prefetch_depth` layers ahead."""
    store = StoreSettings(capacity=slots * slot_bytes(container), **settings)
    return load_model(container, offload=OffloadOptions(store, prefetch_depth))


def greedy_logits(loaded, prompt: list[int], steps: int, batch_prompt: bool = True) -> tuple[np.ndarray, list[int]]:
    """Prompt logits (all positions, the prompt in one pass or token by token) and `steps` greedy
    continuation logits, with the tokens chosen."""
    model = loaded.model
    cache = KVCache(loaded.spec, len(prompt) + steps + 1)
    if batch_prompt:
        logits = [model.forward(prompt, cache, all_logits=True)]
    else:
        logits = [model.forward([t], cache, all_logits=True) for t in prompt]
    tokens = []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1][-1])))
        logits.append(model.forward([tokens[-1]], cache))
    return np.concatenate(logits), tokens
