"""GGUF architectures beyond the first ones (engine/formats/gguf_model.py): what each adds to the config.json-style
dict and how its tensors are named, as llama.cpp's converter writes them.

granitemoe (Granite-MoE): a Llama model (Q and K permuted) with Granite's four multipliers as `attention.scale`,
`embedding_scale`, `residual_scale` and `logit_scale`, and its fused experts split into gate and up stacks.
Granite's shared-expert variant (GraniteMoeShared, the same GGUF name with `ffn_*_shexp` tensors) is refused:
Colibri does not run it.

minimax-m2 (MiniMax-M2): q/k norms over the whole projection, `rope.dimension_count` rotated features, sigmoid
routing with the correction bias as `exp_probs_b`, per-expert w1/w2/w3 stacked.

phimoe (Phi-3.5-MoE): written by llama.cpp's Phi-3 class (window, rotated features, LongRoPE factors as tensors)
plus the expert counts; LayerNorms with biases (`*_norm.bias`), an optional head bias (`output.bias`), w1/w3/w2
experts stacked. The sparse mixer's `router_jitter_noise` has no GGUF key: PhiMoE's default (0.01, the released
model's) is used. LongRoPE's cos/sin scale is the file's `rope.scaling.attn_factor`, which the converter computes
as sqrt(1 + ln(s) / ln(original length)) rather than copying the checkpoint's short/long mscale.

ernie4_5-moe (ERNIE-4.5 MoE): `leading_dense_block_count` and `interleave_moe_layer_step` are the checkpoint's
moe_layer_start_index and moe_layer_interval; its moe_layer_end_index has no key, so it is the last block holding a
router, and the MoE layers the keys describe must be those holding routers. Biases (`use_bias`) and the correction
bias (`exp_probs_b`, [1, E] in the checkpoint) are read from the tensors present; moe_norm_min has no key: ERNIE's
default (1e-12, a floor that never acts) is used.
"""

from __future__ import annotations

from typing import Any

from engine.errors import UnsupportedArchitectureError

# GGUF architecture -> (Hugging Face architecture, its MoE variant)
ARCHITECTURES = {
    "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeForCausalLM"),
    "minimax-m2": ("MiniMaxM2ForCausalLM", "MiniMaxM2ForCausalLM"),
    "phimoe": ("PhimoeForCausalLM", "PhimoeForCausalLM"),
    "ernie4_5-moe": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeForCausalLM"),
}
# llama.cpp architectures of models Colibri runs from their Hugging Face folders but does not yet read from GGUF
# (their converters reorder or transform tensors this reader does not undo yet): GGUF name -> model name
FOLDER_ONLY = {
    "qwen3next": "Qwen3-Next", "qwen35moe": "Qwen3.5-MoE", "glm-dsa": "GLM-5 (GlmMoeDsa)",
    "kimi-linear": "Kimi Linear",
}
# architectures whose Q and K projections llama.cpp's converter permutes (its LlamaModel's undo_permute)
PERMUTED_QK = ("granitemoe",)
# where each architecture's routed experts sit in Colibri's names: (prefix, gate, up, down)
MOE_NAMES = {
    "granitemoe": ("block_sparse_moe", "gate_proj", "up_proj", "down_proj"),
    "minimax-m2": ("block_sparse_moe", "w1", "w3", "w2"),
    "phimoe": ("block_sparse_moe", "w1", "w3", "w2"),
}
# per-architecture tensor names beyond gguf_model's shared table
LAYER_NAMES: dict[str, dict[str, str]] = {
    "minimax-m2": {"exp_probs_b.bias": "block_sparse_moe.e_score_correction_bias"},
    "phimoe": {"attn_norm.bias": "input_layernorm.bias", "ffn_norm.bias": "post_attention_layernorm.bias"},
    "ernie4_5-moe": {
        **{f"ffn_{p}.bias": f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")},
        **{f"ffn_{p}_shexp.{kind}": f"mlp.shared_experts.{p}_proj.{kind}"
           for p in ("gate", "up", "down") for kind in ("weight", "bias")},
        "exp_probs_b.bias": "mlp.moe_statics.e_score_correction_bias",
    },
}
# per-architecture names of tensors outside the blocks, beyond gguf_model's shared table
GLOBAL_NAMES: dict[str, dict[str, str]] = {
    "phimoe": {"output_norm.bias": "model.norm.bias", "output.bias": "lm_head.bias"},
    "ernie4_5-moe": {"output.bias": "lm_head.bias"},
}
# tensors whose checkpoint shape is [1, n] where a GGUF file may hold [n]
ROW_VECTORS = {"ernie4_5-moe": ("moe_statics.e_score_correction_bias",)}
# architectures whose LongRoPE factors are tensors (rope_factors_long/short), read into the config
ROPE_FACTOR_TENSORS = ("phimoe",)


def _granitemoe_config(cfg: dict[str, Any], get, tensors: frozenset[str]) -> None:
    if get("expert_shared_feed_forward_length", 0) or any("_shexp." in t for t in tensors):
        raise UnsupportedArchitectureError(
            f"{get.path}: this granitemoe GGUF has shared experts (a GraniteMoeShared model), which Colibri does "
            "not run; use a Granite-MoE model without them (e.g. granite-3.0-3b-a800m)")
    cfg |= {
        "num_local_experts": int(get("expert_count")),
        # the converter writes Granite's (per-expert) intermediate_size as the feed-forward length
        "intermediate_size": int(get("expert_feed_forward_length", cfg["intermediate_size"])),
        "attention_multiplier": float(get("attention.scale", 1.0)),
        "embedding_multiplier": float(get("embedding_scale", 1.0)),
        "residual_multiplier": float(get("residual_scale", 1.0)),
        "logits_scaling": float(get("logit_scale", 1.0)),
    }
    cfg.pop("head_dim", None)        # the converter drops Granite's head_dim: heads split the hidden size
    for key in ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob"):
        cfg.pop(key, None)


def _minimax_m2_config(cfg: dict[str, Any], get, tensors: frozenset[str]) -> None:
    if int(get("expert_gating_func", 2)) != 2:
        raise UnsupportedArchitectureError(f"{get.path}: this minimax-m2 GGUF does not score experts by sigmoid, "
                                           "as MiniMax-M2 does; convert the model again")
    cfg |= {
        "num_local_experts": int(get("expert_count")),
        "intermediate_size": int(get("expert_feed_forward_length", cfg["intermediate_size"])),
        "rotary_dim": int(get("rope.dimension_count", cfg["head_dim"])),
        "use_routing_bias": any(t.endswith(".exp_probs_b.bias") for t in tensors),
        "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
    }
    for key in ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob"):
        cfg.pop(key, None)


def _phimoe_config(cfg: dict[str, Any], get, tensors: frozenset[str]) -> None:
    window = int(get("attention.sliding_window", 0))     # the Phi-3 class writes 0 for none
    orig = int(get("rope.scaling.original_context_length", cfg["max_position_embeddings"]))
    rope = cfg["rope_parameters"]
    rope["partial_rotary_factor"] = int(get("rope.dimension_count", cfg["head_dim"])) / cfg["head_dim"]
    if "rope_factors_long.weight" in tensors:    # the factors themselves are read with the tensors (GGUFModel)
        scale = float(get("rope.scaling.attn_factor", 1.0))
        rope |= {"rope_type": "longrope", "original_max_position_embeddings": orig,
                 "short_mscale": scale, "long_mscale": scale}
    cfg |= {
        "num_local_experts": int(get("expert_count")),
        "sliding_window": window or None,
        "original_max_position_embeddings": orig,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "lm_head_bias": "output.bias" in tensors,
        "router_jitter_noise": 0.01,
    }
    for key in ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob"):
        cfg.pop(key, None)


def _ernie_config(cfg: dict[str, Any], get, tensors: frozenset[str]) -> None:
    n = cfg["num_hidden_layers"]
    start, interval = int(get("leading_dense_block_count", 0)), int(get("interleave_moe_layer_step", 1))
    routed = sorted(i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in tensors)
    end = routed[-1] if routed else n - 1
    described = [i for i in range(n) if interval >= 1 and (i + 1) % interval == 0 and start <= i <= end]
    if routed != described:
        raise UnsupportedArchitectureError(
            f"{get.path}: this ernie4_5-moe GGUF has routers in blocks {routed}, but its leading_dense_block_count "
            f"({start}) and interleave_moe_layer_step ({interval}) describe MoE blocks {described}; Colibri reads "
            "only that layout: convert the model again with llama.cpp's convert_hf_to_gguf.py")
    cfg |= {
        "moe_num_experts": int(get("expert_count")),
        "moe_k": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "moe_num_shared_experts": int(get("expert_shared_count", 0)),
        "moe_layer_start_index": start, "moe_layer_interval": interval, "moe_layer_end_index": end,
        "use_bias": "blk.0.attn_q.bias" in tensors,
        "moe_use_aux_free": any(t.endswith(".exp_probs_b.bias") for t in tensors),
        "moe_norm_min": 1e-12,
    }
    for key in ("num_experts", "num_local_experts", "num_experts_per_tok", "shared_expert_intermediate_size",
                "norm_topk_prob"):
        cfg.pop(key, None)


# architecture -> what it adds to the config (metadata getter, tensor names)
ARCH_CONFIG = {"ernie4_5-moe": _ernie_config, "granitemoe": _granitemoe_config, "minimax-m2": _minimax_m2_config, "phimoe": _phimoe_config}
