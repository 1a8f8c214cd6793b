"""Prefill: a prompt run through the model in chunks, for generation, speculation and batching."""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from engine.kv import KVCache
from engine.models.transformer import Transformer

PREFILL_CHUNK = 256  # prompt tokens per forward pass: bounds the [H, T, S] score arrays


def prefill_chunks(
    model: Transformer, prompt: Sequence[int], cache: KVCache, *, all_logits: bool = False, chunk: int = PREFILL_CHUNK,
    hidden: list[np.ndarray] | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """Run the prompt through the model chunk by chunk, yielding (tokens done, that chunk's logits); each
    chunk's hidden states before the final norm [chunk, hidden] go to `hidden` when given."""
    for start in range(0, len(prompt), chunk):
        logits = model.forward(prompt[start : start + chunk], cache, all_logits=all_logits, hidden=hidden)
        yield min(start + chunk, len(prompt)), logits


def prefill(
    model: Transformer, prompt: Sequence[int], cache: KVCache, *, all_logits: bool = False, chunk: int = PREFILL_CHUNK,
    hidden: list[np.ndarray] | None = None,
) -> np.ndarray:
    """The prompt's last logits [V] (or all of them, [T, V]) after running it through the model (its hidden
    states before the final norm appended to `hidden`, chunk by chunk, when given)."""
    outs = [logits for _, logits in prefill_chunks(model, prompt, cache, all_logits=all_logits, chunk=chunk,
                                                   hidden=hidden)]
    return np.concatenate(outs) if all_logits else outs[-1][-1]
