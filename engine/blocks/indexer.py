"""DeepSeek sparse attention's indexer (GLM-5): which keys each query of a latent-attention layer attends to.

A light scorer beside the attention: per query, `n_heads` small heads from the q LoRA latent, one key per
token (cached beside the latent), score = sum_h w_h * relu(q_h . k * D^-0.5) with per-token head weights
w from the hidden state. The query attends to its `topk` best keys, or to every key when it sees no more
than `topk`. A `shared` layer has no indexer: it takes the selection of its source layer in the same pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.blocks.linear import Probe, linear
from engine.errors import GenerationError
from engine.kernels.rows import rope_rows
from engine.kernels.sparse import top_keys
from engine.spec import IndexerSpec
from engine.weights import Weights


def indexer_shapes(spec: IndexerSpec, prefix: str, hidden: int, q_lora_rank: int) -> dict[str, tuple[int, ...]]:
    """The tensors of one indexer (none for a shared layer), by name, with their shapes."""
    if spec.shared:
        return {}
    return {
        f"{prefix}.wq_b.weight": (spec.n_heads * spec.head_dim, q_lora_rank),
        f"{prefix}.wk.weight": (spec.head_dim, hidden),
        f"{prefix}.k_norm.weight": (spec.head_dim,),
        f"{prefix}.k_norm.bias": (spec.head_dim,),
        f"{prefix}.weights_proj.weight": (spec.n_heads, hidden),
    }


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis in float32: (x - mean) / sqrt(var + eps) * weight + bias."""
    mean = x.mean(axis=-1, keepdims=True, dtype=np.float32)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True, dtype=np.float32)
    return (centred / np.sqrt(var + np.float32(eps)) * weight + bias).astype(np.float32)


@dataclass(frozen=True)
class IndexerRows:
    """The indexer's projections of some rows."""

    keys: np.ndarray              # [T, Di]
    queries: np.ndarray           # [T, Hi, Di]
    weights: np.ndarray           # [T, Hi] per-head weights, times Hi^-0.5

    def __getitem__(self, rows: slice) -> "IndexerRows":
        return IndexerRows(self.keys[rows], self.queries[rows], self.weights[rows])


@dataclass(frozen=True)
class Indexer:
    """One layer's indexer weights (None for a shared layer) and its selection."""

    spec: IndexerSpec
    prefix: str                   # e.g. "model.layers.3.self_attn.indexer"
    wq: object = None             # [Hi*Di, Rq] (float32 or quantized)
    wk: object = None             # [Di, hidden]
    k_norm: np.ndarray | None = None       # [Di]
    k_bias: np.ndarray | None = None       # [Di]
    w_heads: object = None        # [Hi, hidden]

    @classmethod
    def load(cls, spec: IndexerSpec, w: Weights, prefix: str) -> "Indexer":
        """Take the indexer's tensors from `w` (a shared layer has none)."""
        if spec.shared:
            return cls(spec, prefix)
        return cls(spec, prefix, w[f"{prefix}.wq_b.weight"], w[f"{prefix}.wk.weight"], w[f"{prefix}.k_norm.weight"],
                   w[f"{prefix}.k_norm.bias"], w[f"{prefix}.weights_proj.weight"])

    def project(self, x: np.ndarray, q_latent: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                probe: Probe | None = None) -> "IndexerRows | None":
        """The indexer's keys, queries and head weights of rows x [T, hidden] (normed hidden states) with q LoRA
        latents q_latent [T, Rq] at the positions of cos, sin [T, rope_dim/2]; None for a shared layer."""
        s, t = self.spec, x.shape[0]
        if s.shared:
            return None
        if probe is not None:
            probe(f"{self.prefix}.wk.weight", x)
            probe(f"{self.prefix}.wq_b.weight", q_latent)
            probe(f"{self.prefix}.weights_proj.weight", x)
        k = layer_norm(linear(x, self.wk), self.k_norm, self.k_bias, s.norm_eps)              # [T, Di]
        k = rope_rows(k[:, None, :], cos, sin, s.rope_dim, s.rope_interleaved)[:, 0]
        q = linear(q_latent, self.wq).reshape(t, s.n_heads, s.head_dim)                  # [T, Hi, Di]
        q = rope_rows(q, cos, sin, s.rope_dim, s.rope_interleaved)
        w = linear(x, self.w_heads) * np.float32(s.n_heads**-0.5)                        # [T, Hi]
        return IndexerRows(k, q, w)

    def select(self, rows: "IndexerRows | None", positions: np.ndarray, cache) -> tuple[np.ndarray, np.ndarray]:
        """The keys one sequence's rows (at `positions`) attend to: (positions [T, K], counts [T]).

        Their indexer keys go to `cache` (the layer's view of the sequence) before scoring: a query sees itself.
        """
        s = self.spec
        if s.shared:
            return self._shared(cache, positions)
        cache.write_index(int(positions[0]), rows.keys)
        scores = cache.index_scores(rows.queries, rows.weights, positions, s.head_dim**-0.5)   # [T, S]
        sel, counts = top_keys(scores, positions, s.topk)
        cache.selected = (int(positions[0]), len(positions), sel, counts)
        return sel, counts

    def _shared(self, cache, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The selection the source layer made for these rows in this pass."""
        got = cache.seq.layers[self.spec.source].selected
        if got is None or got[:2] != (int(positions[0]), len(positions)):
            raise GenerationError(f"{self.prefix}: layer {self.spec.source}'s sparse-attention selection for "
                                  "these rows is missing; the layers ran out of order")
        return got[2], got[3]
