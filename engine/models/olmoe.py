"""OLMoE: attention with an RMSNorm over the whole q and k projections (and optional clip_qkv),
and a softmax top-k MoE in every layer."""

from __future__ import annotations

from engine.models.config import ROPE_BUFFERS, Config, gqa_attention, model_fields, moe_counts
from engine.spec import LayerSpec, ModelSpec, MoESpec

ARCHITECTURES = ("OlmoeForCausalLM",)


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of an OLMoE config.json."""
    n_experts, top_k = cfg.first(("num_experts", "num_local_experts")), cfg.req("num_experts_per_tok")
    moe_counts(cfg, n_experts, top_k, "num_experts")
    moe = MoESpec(
        n_experts=n_experts,
        top_k=top_k,
        expert_ffn=cfg.req("intermediate_size"),
        norm_topk_prob=cfg.opt("norm_topk_prob", False, bool),
        act=cfg.opt("hidden_act", "silu", str),
    )
    bias = cfg.opt("attention_bias", False, bool)
    attn = gqa_attention(cfg, qkv_bias=bias, o_bias=bias, qk_norm="full")
    layers = tuple(LayerSpec(attn, moe) for _ in range(cfg.req("num_hidden_layers")))
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg))


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read."""
    return ROPE_BUFFERS
