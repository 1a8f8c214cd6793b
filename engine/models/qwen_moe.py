"""Qwen2-MoE and Qwen3-MoE: softmax top-k routing; Qwen2-MoE adds a sigmoid-gated shared expert.

Which layers are sparse follows `decoder_sparse_step` and `mlp_only_layers`; the others have a
dense MLP of `intermediate_size`.
"""

from __future__ import annotations

from engine.models.config import (
    ROPE_BUFFERS,
    Config,
    dense_mlp,
    gqa_attention,
    model_fields,
    moe_counts,
    sliding_windows,
)
from engine.spec import LayerSpec, MLPSpec, ModelSpec, MoESpec

ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a Qwen2-MoE or Qwen3-MoE config.json."""
    qwen3 = architecture == "Qwen3MoeForCausalLM"
    act = cfg.opt("hidden_act", "silu", str)
    n_experts = cfg.first(("num_experts", "num_local_experts"))
    shared = 0 if qwen3 else cfg.opt("shared_expert_intermediate_size", 0, int)
    moe = MoESpec(
        n_experts=n_experts,
        top_k=cfg.req("num_experts_per_tok"),
        expert_ffn=cfg.req("moe_intermediate_size"),
        norm_topk_prob=cfg.opt("norm_topk_prob", False, bool),
        shared_ffn=shared,
        shared_gate=shared > 0,
        act=act,
    )
    step = cfg.opt("decoder_sparse_step", 1, int)
    mlp_only_list = cfg.opt("mlp_only_layers", [], list)
    cfg.require(all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only_list), "mlp_only_layers",
                mlp_only_list, "a list of layer indices")
    mlp_only = set(mlp_only_list)
    n = cfg.req("num_hidden_layers")
    sparse_layers = [i not in mlp_only and n_experts > 0 and (i + 1) % step == 0 for i in range(n)]
    if any(sparse_layers):
        moe_counts(cfg, n_experts, moe.top_k, "num_experts")
    dense = dense_mlp(cfg, act) if not all(sparse_layers) else MLPSpec(intermediate=cfg.req("intermediate_size"), act=act)
    windows = sliding_windows(cfg, n)
    if qwen3:
        bias = cfg.opt("attention_bias", False, bool)
        attn_kw = dict(qkv_bias=bias, o_bias=bias, qk_norm="head")
    else:
        attn_kw = dict(qkv_bias=cfg.opt("qkv_bias", True, bool), o_bias=False)
    layers = []
    for i, sparse in enumerate(sparse_layers):
        layers.append(LayerSpec(gqa_attention(cfg, sliding_window=windows[i], **attn_kw), moe if sparse else dense))
    return ModelSpec(architecture=architecture, layers=tuple(layers), **model_fields(cfg))


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read."""
    return ROPE_BUFFERS
