"""Synth shapes of the newer MoE families: MiniMax-M2, ERNIE 4.5, Granite-MoE, Phi-3.5-MoE, DeepSeek-V2, and the
hybrid linear-attention models (Qwen3-Next, Qwen3.5-MoE, Kimi Linear).

Each is the released checkpoint's config.json values (the sizes that set memory and disk), with the synthetic
tokenizer's token ids and without MTP layers, as shapes.py's published shapes, and the keys transformers
adds when it saves the config (so that a config read and saved again by transformers is the same). Where a shape's RoPE
scaling changes no size (Phi-3.5-MoE's LongRoPE factors) the default RoPE stands in for it.
"""

from __future__ import annotations

from typing import Any

from app.bench.synth.config import Shape, common_config


def minimax_m2_config(*, head_dim: int, rotary_dim: int, experts: int, top_k: int, **kw: Any) -> dict[str, Any]:
    """A MiniMaxM2ForCausalLM config.json: whole-projection q/k norms, partial rotary, sigmoid routing with a
    correction bias, every layer routed (`ffn` is the expert size)."""
    config = common_config("MiniMaxM2ForCausalLM", "minimax_m2", **kw) | {
        "attn_type_list": [1] * kw["layers"], "head_dim": head_dim, "num_experts_per_tok": top_k,
        "num_local_experts": experts, "qk_norm_type": "per_layer", "rotary_dim": rotary_dim,
        "scoring_func": "sigmoid", "shared_intermediate_size": 0, "use_qk_norm": True, "use_routing_bias": True,
        "output_router_logits": False, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
    }
    config["rope_parameters"] |= {"partial_rotary_factor": rotary_dim / head_dim}    # as transformers saves it
    return config


def ernie_config(*, experts: int, top_k: int, moe_ffn: int, shared_experts: int, **kw: Any) -> dict[str, Any]:
    """An Ernie4_5_MoeForCausalLM config.json: the first layer dense, then routed layers with shared experts."""
    return common_config("Ernie4_5_MoeForCausalLM", "ernie4_5_moe", **kw) | {
        "moe_intermediate_size": moe_ffn, "moe_k": top_k, "moe_layer_end_index": kw["layers"] - 1,
        "moe_layer_interval": 1, "moe_layer_start_index": 1, "moe_num_experts": experts,
        "moe_num_shared_experts": shared_experts, "moe_use_aux_free": True, "tie_word_embeddings": True,
        "use_bias": False, "moe_norm_min": 1e-12, "num_nextn_predict_layers": None, "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }


def granitemoe_config(*, experts: int, top_k: int, multipliers: dict[str, float], **kw: Any) -> dict[str, Any]:
    """A GraniteMoeForCausalLM config.json: Granite's embedding, residual, attention and logits multipliers."""
    return common_config("GraniteMoeForCausalLM", "granitemoe", **kw) | multipliers | {
        "attention_bias": False, "num_experts_per_tok": top_k, "num_local_experts": experts,
        "tie_word_embeddings": True, "output_router_logits": False, "router_aux_loss_coef": 0.001,
    }


def phimoe_config(*, experts: int, **kw: Any) -> dict[str, Any]:
    """A PhimoeForCausalLM config.json: LayerNorms, attention and head biases, the sparse mixer (two experts)."""
    return common_config("PhimoeForCausalLM", "phimoe", **kw) | {
        "attention_bias": True, "lm_head_bias": True, "num_experts_per_tok": 2, "num_local_experts": experts,
        "router_jitter_noise": 0.01, "sliding_window": kw["max_pos"], "input_jitter_noise": 0.0,
        "output_router_logits": False, "router_aux_loss_coef": 0.001,
    }


def deepseek_v2_config(*, experts: int, top_k: int, moe_ffn: int, q_lora: int | None, groups: tuple[int, int],
                       routed_scaling: float, **kw: Any) -> dict[str, Any]:
    """A DeepseekV2ForCausalLM config.json: latent attention (a query low-rank or none), one dense layer, softmax
    routing (greedy, or group-limited over `groups` = (n_group, topk_group)), two shared experts, YaRN."""
    config = common_config("DeepseekV2ForCausalLM", "deepseek_v2", kv_heads=kw["heads"], **kw) | {
        "first_k_dense_replace": 1, "kv_lora_rank": 512, "moe_intermediate_size": moe_ffn, "moe_layer_freq": 1,
        "n_group": groups[0], "n_routed_experts": experts, "n_shared_experts": 2, "norm_topk_prob": False,
        "num_experts_per_tok": top_k, "q_lora_rank": q_lora, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "routed_scaling_factor": routed_scaling, "scoring_func": "softmax", "topk_group": groups[1],
        "topk_method": "group_limited_greedy" if groups[0] > 1 else "greedy", "v_head_dim": 128,
        "attention_bias": False, "head_dim": 64, "mlp_bias": False, "output_router_logits": False,
        "pretraining_tp": 1, "qk_head_dim": 192,
    }
    config["rope_parameters"] |= {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
    return config


def _every_fourth_full(layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]


def qwen3_next_config(*, arch: str, model_type: str, experts: int, top_k: int, moe_ffn: int, value_heads: int,
                      **kw: Any) -> dict[str, Any]:
    """A Qwen3-Next (or Qwen3.5-MoE text) config.json: gated DeltaNet layers, every fourth gated full attention
    with a quarter of its head rotated, every layer routed with a gated shared expert."""
    config = common_config(arch, model_type, **kw) | {
        "head_dim": 256, "layer_types": _every_fourth_full(kw["layers"]), "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": value_heads,
        "linear_value_head_dim": 128, "moe_intermediate_size": moe_ffn, "num_experts": experts,
        "num_experts_per_tok": top_k, "shared_expert_intermediate_size": moe_ffn, "attention_bias": False,
        "output_router_logits": False, "router_aux_loss_coef": 0.001,
    }
    if model_type == "qwen3_next":
        config |= {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    else:                               # Qwen3.5's text model has no dense layers, nor their size
        config.pop("intermediate_size")
    config["rope_parameters"] |= {"partial_rotary_factor": 0.25}
    return config


def kimi_linear_config(*, full_layers: list[int], experts: int, top_k: int, moe_ffn: int, **kw: Any) -> dict[str, Any]:
    """A KimiLinearForCausalLM config.json: Kimi delta attention, latent full attention without RoPE at the
    1-indexed `full_layers`, the first layer dense, sigmoid routing with a shared expert."""
    layers = kw["layers"]
    # keys in the spelling transformers saves (its attribute_map: model_max_length, num_experts ...)
    config = common_config("KimiLinearForCausalLM", "kimi_linear", kv_heads=kw["heads"], **kw) | {
        "first_k_dense_replace": 1, "kv_lora_rank": 512, "moe_intermediate_size": moe_ffn, "num_expert_group": 1,
        "num_shared_experts": 1, "moe_renormalize": True, "num_experts_per_token": top_k, "num_experts": experts,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "routed_scaling_factor": 2.446,
        "topk_group": 1, "v_head_dim": 128, "attention_bias": False, "head_dim": 64, "output_router_logits": False,
        "pretraining_tp": 1, "qk_head_dim": 192, "model_max_length": kw["max_pos"],
        "layer_types": ["full_attention" if i + 1 in full_layers else "linear_attention" for i in range(layers)],
        "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1),
        "linear_head_dim": 128, "linear_num_heads": 32, "linear_conv_kernel_dim": 4,
    }
    config.pop("rope_parameters")       # its full attention is NoPE
    config.pop("max_position_embeddings")
    return config


FAMILY_SHAPES: tuple[Shape, ...] = (
    Shape("minimax-m2", "MiniMax-M2 (MiniMaxAI/MiniMax-M2, 2025-10 release): 256 experts top-8, 229 B",
          minimax_m2_config(hidden=3072, layers=62, heads=48, kv_heads=8, head_dim=128, rotary_dim=64, experts=256,
                            top_k=8, ffn=1536, vocab=200064, rope_theta=5e6, max_pos=196608, eps=1e-6)),
    Shape("ernie-4.5-21b-a3b", "ERNIE-4.5-21B-A3B (baidu/ERNIE-4.5-21B-A3B-PT, 2025-06 release): 64 experts top-6 "
          "+ 2 shared, 21.8 B",
          ernie_config(hidden=2560, layers=28, heads=20, kv_heads=4, experts=64, top_k=6, moe_ffn=1536,
                       shared_experts=2, ffn=12288, vocab=103424, rope_theta=5e5, max_pos=131072, eps=1e-5)),
    Shape("granite-3.0-3b-a800m", "Granite 3.0 3B-A800M (ibm-granite/granite-3.0-3b-a800m-instruct, 2024-10 "
          "release): 40 experts top-8, 3.3 B",
          granitemoe_config(hidden=1536, layers=32, heads=24, kv_heads=8, experts=40, top_k=8, ffn=512, vocab=49155,
                            rope_theta=1e4, max_pos=4096, eps=1e-6,
                            multipliers={"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                         "attention_multiplier": 0.015625, "logits_scaling": 6.0})),
    Shape("phi-3.5-moe", "Phi-3.5-MoE (microsoft/Phi-3.5-MoE-instruct, 2024-08 release): 16 experts top-2, 41.9 B",
          phimoe_config(hidden=4096, layers=32, heads=32, kv_heads=8, experts=16, ffn=6400, vocab=32064,
                        rope_theta=1e4, max_pos=131072, eps=1e-5)),
    Shape("deepseek-v2-lite", "DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite, 2024-05 release): 64 experts top-6 "
          "+ 2 shared, latent attention, 15.7 B",
          deepseek_v2_config(hidden=2048, layers=27, heads=16, experts=64, top_k=6, moe_ffn=1408, ffn=10944,
                             q_lora=None, groups=(1, 1), routed_scaling=1.0, vocab=102400, rope_theta=1e4,
                             max_pos=163840, eps=1e-6)),
    Shape("deepseek-v2", "DeepSeek-V2 (deepseek-ai/DeepSeek-V2, 2024-05 release): 160 experts top-6 + 2 shared, "
          "group-limited, latent attention, 236 B",
          deepseek_v2_config(hidden=5120, layers=60, heads=128, experts=160, top_k=6, moe_ffn=1536, ffn=12288,
                             q_lora=1536, groups=(8, 3), routed_scaling=16.0, vocab=102400, rope_theta=1e4,
                             max_pos=163840, eps=1e-6)),
    Shape("qwen3-next-80b-a3b", "Qwen3-Next-80B-A3B (Qwen/Qwen3-Next-80B-A3B-Instruct, 2025-09 release): gated "
          "DeltaNet + gated attention, 512 experts top-10, 79.7 B",
          qwen3_next_config(arch="Qwen3NextForCausalLM", model_type="qwen3_next", hidden=2048, layers=48, heads=16,
                            kv_heads=2, experts=512, top_k=10, moe_ffn=512, value_heads=32, ffn=5120,
                            vocab=151936, rope_theta=1e7, max_pos=262144, eps=1e-6)),
    Shape("qwen3.5-35b-a3b", "Qwen3.5-35B-A3B's text model (Qwen/Qwen3.5-35B-A3B, 2026-02 release): gated "
          "DeltaNet + gated attention, 256 experts top-8, 34.7 B",
          qwen3_next_config(arch="Qwen3_5MoeForCausalLM", model_type="qwen3_5_moe_text", hidden=2048, layers=40,
                            heads=16, kv_heads=2, experts=256, top_k=8, moe_ffn=512, value_heads=32, ffn=0,
                            vocab=248320, rope_theta=1e7, max_pos=262144, eps=1e-6)),
    Shape("kimi-linear-48b-a3b", "Kimi Linear 48B-A3B (moonshotai/Kimi-Linear-48B-A3B-Instruct, 2025-10 release): "
          "Kimi delta attention + latent attention, 256 experts top-8, 49.1 B",
          kimi_linear_config(hidden=2304, layers=27, heads=32, full_layers=[4, 8, 12, 16, 20, 24, 27],
                             experts=256, top_k=8, moe_ffn=1024, ffn=9216, vocab=163840, rope_theta=1e4,
                             max_pos=1048576, eps=1e-5)),
)
