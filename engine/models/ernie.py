"""ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM): GQA with interleaved RoPE, `use_bias` on every projection (attention,
dense and shared MLPs, the output head; not the routed experts), tied embeddings by default, and MoE layers
between `moe_layer_start_index` and `moe_layer_end_index` every `moe_layer_interval`-th layer: softmax scores,
chosen by score + the correction bias held in `moe_statics`, renormalised by their sum (floored at
`moe_norm_min`), plus `moe_num_shared_experts` shared experts as one MLP.
"""

from __future__ import annotations

import dataclasses

from engine.models.config import (
    ROPE_BUFFERS,
    Config,
    gqa_attention,
    model_fields,
    moe_counts,
    with_defaults,
)
from engine.spec import LayerSpec, MLPSpec, ModelSpec, MoESpec

ARCHITECTURES = ("Ernie4_5_MoeForCausalLM",)

# Ernie4_5_MoeConfig's defaults, for keys a config.json leaves out
DEFAULTS = {
    "vocab_size": 103424, "hidden_size": 2560, "intermediate_size": 12288, "num_hidden_layers": 28,
    "num_attention_heads": 20, "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "rope_theta": 500000.0, "moe_intermediate_size": 1536,
    "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_end_index": -1, "moe_layer_interval": 1,
    "moe_norm_min": 1e-12,
}


def _sparse_layers(cfg: Config, n: int) -> list[bool]:
    """Which layers are MoE: every interval-th (counting from 1) between the start and end indices, inclusive."""
    start, end = cfg.opt("moe_layer_start_index", 1, int), cfg.opt("moe_layer_end_index", -1, int)
    interval = cfg.opt("moe_layer_interval", 1, int)
    cfg.require(interval >= 1, "moe_layer_interval", interval, "an interval >= 1")
    end = n - 1 if end == -1 else end                       # -1: up to the last layer (other values as given)
    return [(i + 1) % interval == 0 and start <= i <= end for i in range(n)]


def _norm_floor(cfg: Config, top_k: int, n_experts: int) -> float:
    """The renormalisation's floor where it can act, else 0 (then the compiled router runs).

    The chosen experts' softmax scores sum to at least top_k / n_experts, so a floor below that (ERNIE's 1e-12)
    never acts: rounding moves the sum by a few parts in ten million, far inside the margin kept here.
    """
    floor = cfg.opt("moe_norm_min", 1e-12, float)
    cfg.require(floor >= 0, "moe_norm_min", floor, "a floor >= 0")
    return 0.0 if floor < 0.999 * top_k / n_experts else floor


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of an ERNIE 4.5 MoE config.json."""
    cfg = with_defaults(cfg, DEFAULTS)
    cfg.require(cfg.opt("use_rmsnorm", True, bool), "use_rmsnorm", False, "true: ERNIE 4.5 MoE runs RMSNorm")
    n = cfg.req("num_hidden_layers")
    bias = cfg.opt("use_bias", False, bool)
    act = cfg.opt("hidden_act", "silu", str)
    sparse = _sparse_layers(cfg, n)
    layers_moe: MoESpec | None = None
    if any(sparse):
        n_experts = cfg.first(("moe_num_experts", "num_experts"), int, 64)
        top_k = cfg.first(("moe_k", "num_experts_per_tok"), int, 6)
        cfg.require(top_k >= 1, "moe_k", top_k, "at least one expert per token")
        moe_counts(cfg, n_experts, top_k, "moe_num_experts")
        expert_ffn = cfg.req("moe_intermediate_size")
        shared = cfg.opt("moe_num_shared_experts", 2, int)
        cfg.require(shared >= 0, "moe_num_shared_experts", shared, "a count >= 0")
        layers_moe = MoESpec(
            n_experts=n_experts,
            top_k=top_k,
            expert_ffn=expert_ffn,
            scoring="softmax",
            norm_topk_prob=True,
            correction_bias=cfg.opt("moe_use_aux_free", True, bool),   # without it, checkpoints carry no statics
            bias_name="moe_statics.e_score_correction_bias",
            bias_shape=(1, n_experts),
            norm_min=_norm_floor(cfg, top_k, n_experts),
            shared_ffn=expert_ffn * shared,
            shared_bias=bias,
            act=act,
            shared_prefix="shared_experts",
        )
    dense = None
    if not all(sparse):
        size = cfg.req("intermediate_size")
        cfg.require(size > 0, "intermediate_size", size, "a positive size for the dense layers")
        dense = MLPSpec(intermediate=size, act=act, bias=bias)
    attn = gqa_attention(cfg, qkv_bias=bias, o_bias=bias)
    cfg.require(attn.rope.dim == attn.head_dim, "partial_rotary_factor", attn.rope.dim / attn.head_dim,
                "1 (or unset): ERNIE 4.5 rotates every feature of a head")
    # pairs (x0, x1), (x2, x3) ... rotate together
    attn = dataclasses.replace(attn, rope=dataclasses.replace(attn.rope, interleaved=True))
    layers = tuple(LayerSpec(attn, layers_moe if s else dense) for s in sparse)
    return ModelSpec(architecture=architecture, layers=layers, lm_head_bias=bias, **model_fields(cfg))


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints carry that the model does not read: the multi-token-prediction block.

    ERNIE 4.5 checkpoints ship their MTP layer under names holding `mtp` (`model.mtp_block.0...`,
    `model.mtp_linear_proj.0...`), which the reference skips on load as well.
    """
    return ROPE_BUFFERS + (r".*mtp.*",)
