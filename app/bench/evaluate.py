"""`colibri eval`: perplexity on a text, and agreement with a reference model (KL, top-1).

The text is scored in windows of `ctx` tokens that overlap by half: each token is scored once,
with at least half a window of context before it (except at the start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from engine.errors import ColibriError
from engine.kv import KVCache
from engine.models.transformer import Transformer


@dataclass(frozen=True)
class EvalResult:
    """Quality figures over the scored tokens."""

    tokens: int
    nll: float                     # mean negative log-likelihood (nats per token)
    kl: float | None = None        # mean KL(reference || model), nats per token
    top1: float | None = None      # share of tokens where both models' argmax agree
    ref_nll: float | None = None

    @property
    def perplexity(self) -> float:
        """exp(mean NLL)."""
        return float(np.exp(self.nll))

    @property
    def ref_perplexity(self) -> float | None:
        """The reference's perplexity on the same tokens."""
        return float(np.exp(self.ref_nll)) if self.ref_nll is not None else None

    def as_dict(self) -> dict:
        """The JSON form."""
        d = {"tokens": self.tokens, "perplexity": round(self.perplexity, 4), "nll": round(self.nll, 5)}
        if self.kl is not None:
            d |= {"kl": round(self.kl, 6), "top1": round(self.top1, 5), "reference_perplexity": round(self.ref_perplexity, 4)}
        return d


def windows(n: int, ctx: int) -> Iterator[tuple[int, int, int]]:
    """(start, end, first scored position) of overlapping windows covering positions 1..n-1."""
    if n < 2:
        return
    stride = max(ctx // 2, 1)
    start, scored = 0, 1
    while scored < n:
        end = min(start + ctx, n)
        yield start, end, scored
        scored = end
        start = max(end - (ctx - stride), 0) if end < n else end


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def evaluate(model: Transformer, ids: list[int], ctx: int = 512, reference: Transformer | None = None,
             progress: Callable[[int, int], None] | None = None) -> EvalResult:
    """Score `ids` with the model (and the reference on the same windows)."""
    if len(ids) < 2:
        raise ColibriError("the text has fewer than 2 tokens: nothing to score")
    if reference is not None and reference.spec.vocab_size != model.spec.vocab_size:
        raise ColibriError("the reference model has another vocabulary; compare models that share a tokenizer")
    nll = kl = 0.0
    agree = scored = 0
    ref_nll = 0.0
    for start, end, first in windows(len(ids), ctx):
        chunk = ids[start:end]
        targets = np.asarray(ids[first:end])
        rows = slice(first - start - 1, end - start - 1)   # logits at position p predict token p+1
        lp = _log_softmax(model.forward(chunk, KVCache(model.spec, len(chunk)), all_logits=True)[rows])
        nll -= lp[np.arange(len(targets)), targets].sum()
        if reference is not None:
            rp = _log_softmax(reference.forward(chunk, KVCache(reference.spec, len(chunk)), all_logits=True)[rows])
            ref_nll -= rp[np.arange(len(targets)), targets].sum()
            kl += float((np.exp(rp) * (rp - lp)).sum())
            agree += int((rp.argmax(-1) == lp.argmax(-1)).sum())
        scored += len(targets)
        if progress is not None:
            progress(end, len(ids))
    if reference is None:
        return EvalResult(scored, nll / scored)
    return EvalResult(scored, nll / scored, kl / scored, agree / scored, ref_nll / scored)
