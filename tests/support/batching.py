"""Decoding several sequences alone and together, for the tests that batched decoding gives each sequence the
logits of its own single steps."""

from __future__ import annotations

import numpy as np

from engine.fused.batch import BatchedDecode
from engine.kv import KVCache, KVPool


def greedy_alone(model, pool: KVPool, prompts: list[list[int]], steps: int) -> list[np.ndarray]:
    """Each sequence's greedy steps by itself (a single fused step each): logits [steps, V] per sequence."""
    out = []
    for p in prompts:
        cache = KVCache(model.spec, 64, pool=pool)
        rows = [model.forward(p, cache)[-1]]
        for _ in range(steps):
            rows.append(model.forward([int(rows[-1].argmax())], cache)[-1])
        cache.release()
        out.append(np.stack(rows[1:]))
    return out


def greedy_together(model, pool: KVPool, prompts: list[list[int]], steps: int, monkeypatch,
                    way: int) -> tuple[list[np.ndarray], int]:
    """The same sequences' steps run together (`way` 0: one step for all, 1: a fused step each), and how many
    steps ran as the batch's fused step."""
    calls = []
    real = BatchedDecode.run
    monkeypatch.setattr(BatchedDecode, "run", lambda self, *a: (calls.append(1), real(self, *a))[1])
    monkeypatch.setattr(model.context.apart[len(prompts)], "pick", lambda preferred, other: way)
    caches = [KVCache(model.spec, 64, pool=pool) for _ in prompts]
    logits = [model.forward(p, c)[-1] for p, c in zip(prompts, caches)]
    out: list[list[np.ndarray]] = [[] for _ in prompts]
    for _ in range(steps):
        res = model.forward_batch([([int(x.argmax())], c) for x, c in zip(logits, caches)])
        logits = [r[-1] for r in res]
        for k, x in enumerate(logits):
            out[k].append(x)
    for c in caches:
        c.release()
    return [np.stack(o) for o in out], len(calls)
