"""Multi-head latent attention (DeepSeek-V2/V3): the cache holds the compressed latent.

Keys and values are never expanded per head: the key up-projection is absorbed into the query
and the value up-projection is applied after attention, so each step costs O(S * R) per head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.blocks.attention import Segments
from engine.blocks.indexer import Indexer, indexer_shapes
from engine.blocks.linear import Probe, linear
from engine.blocks.norm import rms_norm
from engine.blocks.rope import Rotary
from engine.spec import MLASpec
from engine.weights import Weights


def mla_shapes(spec: MLASpec, prefix: str, hidden: int) -> dict[str, tuple[int, ...]]:
    """The tensors of one MLA block, by name, with their shapes."""
    h = spec.n_heads
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}.kv_a_proj_with_mqa.weight": (spec.kv_lora_rank + spec.qk_rope_dim, hidden),
        f"{prefix}.kv_a_layernorm.weight": (spec.kv_lora_rank,),
        f"{prefix}.kv_b_proj.weight": (h * (spec.qk_nope_dim + spec.v_head_dim), spec.kv_lora_rank),
        f"{prefix}.o_proj.weight": (hidden, h * spec.v_head_dim),
    }
    if spec.q_lora_rank is None:
        shapes[f"{prefix}.q_proj.weight"] = (h * spec.qk_head_dim, hidden)
    else:
        shapes |= {
            f"{prefix}.q_a_proj.weight": (spec.q_lora_rank, hidden),
            f"{prefix}.q_a_layernorm.weight": (spec.q_lora_rank,),
            f"{prefix}.q_b_proj.weight": (h * spec.qk_head_dim, spec.q_lora_rank),
        }
    if spec.bias:
        shapes[f"{prefix}.kv_a_proj_with_mqa.bias"] = (spec.kv_lora_rank + spec.qk_rope_dim,)
        shapes[f"{prefix}.o_proj.bias"] = (hidden,)
        if spec.q_lora_rank is not None:
            shapes[f"{prefix}.q_a_proj.bias"] = (spec.q_lora_rank,)
    if spec.indexer is not None:
        shapes |= indexer_shapes(spec.indexer, f"{prefix}.indexer", hidden, spec.q_lora_rank)
    return shapes


@dataclass(frozen=True)
class LatentAttention:
    """One MLA block's weights and its forward pass."""

    spec: MLASpec
    rotary: Rotary
    rms_eps: float
    prefix: str                   # tensor name prefix, e.g. "model.layers.3.self_attn"
    wq: np.ndarray | None         # [H*(dn+dr), hidden] when there is no q LoRA
    wq_a: np.ndarray | None       # [Rq, hidden]
    q_a_norm: np.ndarray | None   # [Rq]
    wq_b: np.ndarray | None       # [H*(dn+dr), Rq]
    wkv_a: np.ndarray             # [R+dr, hidden]
    kv_a_norm: np.ndarray         # [R]
    w_uk: np.ndarray              # [H, dn, R] key up-projection (absorbed into q)
    w_uv: np.ndarray              # [H, dv, R] value up-projection
    wo: np.ndarray                # [hidden, H*dv]
    bq_a: np.ndarray | None = None
    bkv_a: np.ndarray | None = None
    bo: np.ndarray | None = None
    indexer: Indexer | None = None  # sparse attention: the keys each query attends to

    @property
    def latent_eps(self) -> float:
        """The eps of the q and kv latent norms: the spec's own (DeepSeek keeps 1e-6), else the model's."""
        return self.spec.norm_eps if self.spec.norm_eps is not None else self.rms_eps

    @classmethod
    def load(cls, spec: MLASpec, w: Weights, prefix: str, rotary: Rotary, rms_eps: float) -> "LatentAttention":
        """Take the block's tensors from `w`; splits kv_b_proj into its key and value halves.

        The q / kv latents' norms use `spec.norm_eps` when the family sets it, else `rms_eps`."""
        kv_b = w.dense(f"{prefix}.kv_b_proj.weight").reshape(spec.n_heads, spec.qk_nope_dim + spec.v_head_dim, spec.kv_lora_rank)
        indexer = Indexer.load(spec.indexer, w, f"{prefix}.indexer") if spec.indexer is not None else None
        return cls(
            spec, rotary, rms_eps, prefix,
            w.get(f"{prefix}.q_proj.weight"), w.get(f"{prefix}.q_a_proj.weight"),
            w.get(f"{prefix}.q_a_layernorm.weight"), w.get(f"{prefix}.q_b_proj.weight"),
            w[f"{prefix}.kv_a_proj_with_mqa.weight"], w[f"{prefix}.kv_a_layernorm.weight"],
            np.ascontiguousarray(kv_b[:, : spec.qk_nope_dim]), np.ascontiguousarray(kv_b[:, spec.qk_nope_dim :]),
            w[f"{prefix}.o_proj.weight"],
            w.get(f"{prefix}.q_a_proj.bias"), w.get(f"{prefix}.kv_a_proj_with_mqa.bias"), w.get(f"{prefix}.o_proj.bias"),
            indexer,
        )

    def __call__(self, x: np.ndarray, positions: np.ndarray, segments: Segments, probe: Probe | None = None) -> np.ndarray:
        """x [T, hidden] at `positions` -> [T, hidden]; rows of several sequences as in `Attention`,
        each writing its latents to its own cache. With an indexer, each query attends only to the keys
        it selects (their indexer keys cached beside the latents)."""
        s, t, p = self.spec, x.shape[0], self.prefix
        qa = None
        if self.wq is not None:
            if probe is not None:
                probe(f"{p}.q_proj.weight", x)
            q = linear(x, self.wq)
        else:
            qa = linear(x, self.wq_a)
            if self.bq_a is not None:
                qa = qa + self.bq_a
            qa = rms_norm(qa, self.q_a_norm, self.latent_eps)
            if probe is not None:
                probe(f"{p}.q_a_proj.weight", x)
                probe(f"{p}.q_b_proj.weight", qa)
            q = linear(qa, self.wq_b)
        q = q.reshape(t, s.n_heads, s.qk_head_dim)                      # [T, H, dn+dr]
        if probe is not None:
            probe(f"{p}.kv_a_proj_with_mqa.weight", x)
        ckv = linear(x, self.wkv_a)                                     # [T, R+dr]
        if self.bkv_a is not None:
            ckv = ckv + self.bkv_a
        latent = rms_norm(ckv[:, : s.kv_lora_rank], self.kv_a_norm, self.latent_eps)  # [T, R]
        if probe is not None:
            probe(f"{p}.kv_b_proj.weight", latent)
        cos, sin = self.rotary.tables(positions)
        k_rot = self.rotary.apply(ckv[:, None, s.kv_lora_rank :], cos, sin)[:, 0]  # [T, dr]
        q_rot = self.rotary.apply(q[..., s.qk_nope_dim :], cos, sin)    # [T, H, dr]
        ix = self.indexer
        projected = ix.project(x, qa, cos, sin, probe) if ix is not None else None
        out = np.empty((t, s.n_heads, s.v_head_dim), np.float32)
        for rows, cache in segments:
            pos = positions[rows]
            cache.write(int(pos[0]), latent[rows], k_rot[rows])
            selected = None
            if ix is not None:
                selected = ix.select(None if projected is None else projected[rows], pos, cache)
            out[rows] = cache.attend_latent(q[rows, :, : s.qk_nope_dim], q_rot[rows], self.w_uk, self.w_uv, pos,
                                            s.scale, selected)
        out = out.reshape(t, -1)                                        # [T, H*dv]
        if probe is not None:
            probe(f"{p}.o_proj.weight", out)
        out = linear(out, self.wo)
        return out + self.bo if self.bo is not None else out
