"""What the streaming tests share: a prompt's logits and a greedy continuation, to compare bit for bit."""

from __future__ import annotations

import numpy as np

from engine.kv import KVCache


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
