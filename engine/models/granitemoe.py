"""Granite-MoE: Llama attention whose softmax scale is `attention_multiplier`, scaled embeddings
(`embedding_multiplier`) and block outputs (`residual_multiplier`), logits divided by `logits_scaling`,
and a top-k-then-softmax MoE.

Checkpoints hold each layer's experts fused: `block_sparse_moe.input_linear.weight` [E, 2I, hidden] (gate
rows, then up rows) and `output_linear.weight` [E, hidden, I], with the router as `router.layer.weight`
(transformers 5 renames them on load; save_pretrained writes these names back). `fused_tensors` cuts
and renames them into Colibri's per-expert tensors.
"""

from __future__ import annotations

import dataclasses

from engine.formats.fused import FusedTensor, Piece
from engine.models.config import ROPE_BUFFERS, Config, gqa_attention, model_fields, moe_counts
from engine.spec import LayerSpec, ModelSpec, MoESpec

ARCHITECTURES = ("GraniteMoeForCausalLM",)
_MOE = r"model\.layers\.(\d+)\.block_sparse_moe"


def _multiplier(cfg: Config, key: str) -> float:
    value = cfg.opt(key, 1.0, float)
    cfg.require(value > 0, key, value, "a positive multiplier")
    return value


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a Granite-MoE config.json."""
    n_experts, top_k = cfg.first(("num_local_experts", "num_experts"), default=8), cfg.opt("num_experts_per_tok", 2, int)
    moe_counts(cfg, n_experts, top_k, "num_local_experts")
    moe = MoESpec(
        n_experts=n_experts,
        top_k=top_k,
        expert_ffn=cfg.req("intermediate_size"),
        norm_topk_prob=True,        # a softmax over the top-k logits: softmax over all, renormalised
        act=cfg.opt("hidden_act", "silu", str),
        prefix="block_sparse_moe",
    )
    bias = cfg.opt("attention_bias", False, bool)
    attn = gqa_attention(cfg, qkv_bias=bias, o_bias=bias)
    scale = cfg.opt("attention_multiplier", 1.0, float)
    cfg.require(scale > 0, "attention_multiplier", scale, "a positive softmax scale")
    attn = dataclasses.replace(attn, scale=scale)
    layers = tuple(LayerSpec(attn, moe) for _ in range(cfg.req("num_hidden_layers")))
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg),
                     embedding_multiplier=_multiplier(cfg, "embedding_multiplier"),
                     residual_multiplier=_multiplier(cfg, "residual_multiplier"),
                     logits_scaling=_multiplier(cfg, "logits_scaling"))


def fused_tensors(cfg: Config) -> tuple[FusedTensor, ...]:
    """Granite's fused experts and its router, in Colibri's names (both spellings transformers has used)."""
    i = cfg.req("intermediate_size")
    e = r"model.layers.\1.block_sparse_moe.experts.{e}"
    gate_up = (Piece(f"{e}.gate_proj.weight", start=0, stop=i), Piece(f"{e}.up_proj.weight", start=i, stop=2 * i))
    down = (Piece(f"{e}.down_proj.weight"),)
    router = (Piece(r"model.layers.\1.block_sparse_moe.gate.weight"),)
    return (
        FusedTensor(_MOE + r"\.input_linear\.weight", gate_up, per_expert=True),
        FusedTensor(_MOE + r"\.experts\.gate_up_proj", gate_up, per_expert=True),
        FusedTensor(_MOE + r"\.output_linear\.weight", down, per_expert=True),
        FusedTensor(_MOE + r"\.experts\.down_proj", down, per_expert=True),
        FusedTensor(_MOE + r"\.router\.layer\.weight", router),
        FusedTensor(_MOE + r"\.router\.weight", router),
    )


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read."""
    return ROPE_BUFFERS
