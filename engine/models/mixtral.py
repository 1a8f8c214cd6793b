"""Mixtral: Llama attention (optional sliding window) and a softmax top-k MoE of w1/w3/w2 experts."""

from __future__ import annotations

from engine.models.config import ROPE_BUFFERS, Config, gqa_attention, model_fields, moe_counts
from engine.spec import LayerSpec, ModelSpec, MoESpec

ARCHITECTURES = ("MixtralForCausalLM",)


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a Mixtral config.json."""
    n_experts, top_k = cfg.first(("num_local_experts", "num_experts")), cfg.req("num_experts_per_tok")
    moe_counts(cfg, n_experts, top_k, "num_local_experts")
    moe = MoESpec(
        n_experts=n_experts,
        top_k=top_k,
        expert_ffn=cfg.req("intermediate_size"),
        norm_topk_prob=True,  # Mixtral always renormalises the chosen experts' weights
        act=cfg.opt("hidden_act", "silu", str),
        prefix="block_sparse_moe",
        proj_names=("w1", "w3", "w2"),
    )
    window = cfg.opt("sliding_window", None, int) or None     # 0 and null: no window
    attn = gqa_attention(cfg, qkv_bias=False, o_bias=False, sliding_window=window)
    layers = tuple(LayerSpec(attn, moe) for _ in range(cfg.req("num_hidden_layers")))
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg))


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read."""
    return ROPE_BUFFERS
