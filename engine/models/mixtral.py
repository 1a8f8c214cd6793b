"""Mixtral: Llama attention (optional sliding window) and a softmax top-k MoE of w1/w3/w2 experts."""

from __future__ import annotations

from engine.models.config import Config, gqa_attention, model_fields
from engine.spec import LayerSpec, ModelSpec, MoESpec

ARCHITECTURES = ("MixtralForCausalLM",)


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a Mixtral config.json."""
    moe = MoESpec(
        n_experts=cfg.first(("num_local_experts", "num_experts")),
        top_k=cfg.req("num_experts_per_tok"),
        expert_ffn=cfg.req("intermediate_size"),
        norm_topk_prob=True,  # Mixtral always renormalises the chosen experts' weights
        act=cfg.opt("hidden_act", "silu", str),
        prefix="block_sparse_moe",
        proj_names=("w1", "w3", "w2"),
    )
    window = cfg.opt("sliding_window", None, int)
    attn = gqa_attention(cfg, qkv_bias=False, o_bias=False, sliding_window=window)
    layers = tuple(LayerSpec(attn, moe) for _ in range(cfg.req("num_hidden_layers")))
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg))
