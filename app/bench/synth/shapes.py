"""The synth shape table: config.json builders of the families (Llama, Mixtral, OLMoE, Qwen2, Qwen3-MoE, GLM-4.5,
GLM-5, gpt-oss), `SHAPES` (with the newer families of app/bench/synth/families.py), and the config.json of a shape
at a dtype and layer count (`config_for`)."""

from __future__ import annotations

from typing import Any

from app.bench.synth.config import Shape, common_config
from app.bench.synth.families import FAMILY_SHAPES
from engine.errors import ColibriError

# The transformers release whose config.json layout this module writes.
TRANSFORMERS_FORMAT = "5.0.0"

# --dtype -> (safetensors dtype, bytes per element, config.json "dtype")
DTYPES: dict[str, tuple[str, int, str]] = {
    "bf16": ("BF16", 2, "bfloat16"),
    "f16": ("F16", 2, "float16"),
    "f32": ("F32", 4, "float32"),
}


def llama_config(*, head_dim: int, **kw: Any) -> dict[str, Any]:
    """A LlamaForCausalLM config.json (without dtype and version)."""
    return common_config("LlamaForCausalLM", "llama", **kw) | {
        "attention_bias": False, "head_dim": head_dim, "mlp_bias": False, "pretraining_tp": 1,
    }


def mixtral_config(*, head_dim: int, experts: int, top_k: int, **kw: Any) -> dict[str, Any]:
    """A MixtralForCausalLM config.json (without dtype and version)."""
    return common_config("MixtralForCausalLM", "mixtral", **kw) | {
        "head_dim": head_dim, "num_experts_per_tok": top_k, "num_local_experts": experts,
        "output_router_logits": False, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


def olmoe_config(*, experts: int, top_k: int, **kw: Any) -> dict[str, Any]:
    """An OlmoeForCausalLM config.json (without dtype and version)."""
    return common_config("OlmoeForCausalLM", "olmoe", **kw) | {
        "attention_bias": False, "clip_qkv": None, "norm_topk_prob": False, "num_experts": experts,
        "num_experts_per_tok": top_k, "output_router_logits": False, "router_aux_loss_coef": 0.01,
    }


def qwen2_config(**kw: Any) -> dict[str, Any]:
    """A Qwen2ForCausalLM (Qwen2.5) config.json (without dtype and version): Llama's layout, q/k/v biases."""
    return common_config("Qwen2ForCausalLM", "qwen2", **kw) | {
        "layer_types": ["full_attention"] * kw["layers"], "max_window_layers": kw["layers"], "sliding_window": None,
        "use_sliding_window": False,
    }


def qwen3_moe_config(*, head_dim: int, experts: int, top_k: int, moe_ffn: int, **kw: Any) -> dict[str, Any]:
    """A Qwen3MoeForCausalLM config.json (without dtype and version): q/k norms, softmax top-k routing; the
    expert count under transformers 5's name (`num_local_experts`; the release says `num_experts`)."""
    return common_config("Qwen3MoeForCausalLM", "qwen3_moe", **kw) | {
        "attention_bias": False, "decoder_sparse_step": 1, "head_dim": head_dim, "max_window_layers": kw["layers"],
        "mlp_only_layers": [], "moe_intermediate_size": moe_ffn, "norm_topk_prob": True, "num_local_experts": experts,
        "num_experts_per_tok": top_k, "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "use_sliding_window": False,
    }


def glm4_moe_config(*, experts: int, top_k: int, moe_ffn: int, dense_layers: int, shared_experts: int = 1,
                    qk_norm: bool = True, partial_rotary: float = 0.5, head_dim: int | None = None,
                    attention_bias: bool = False, **kw: Any) -> dict[str, Any]:
    """A Glm4MoeForCausalLM (GLM-4.5) config.json (without dtype and version): sigmoid routing with a
    score-correction bias, `dense_layers` dense layers first, partial RoPE."""
    config = common_config("Glm4MoeForCausalLM", "glm4_moe", **kw) | {
        "attention_bias": attention_bias, "first_k_dense_replace": dense_layers, "moe_intermediate_size": moe_ffn,
        "n_group": 1, "n_routed_experts": experts, "n_shared_experts": shared_experts, "norm_topk_prob": True,
        "num_experts_per_tok": top_k, "num_nextn_predict_layers": 0, "output_router_logits": False,
        "routed_scaling_factor": 1.0, "topk_group": 1, "use_qk_norm": qk_norm,
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    config["rope_parameters"] = config["rope_parameters"] | {"partial_rotary_factor": partial_rotary}
    return config


def glm_moe_dsa_config(*, experts: int, top_k: int, moe_ffn: int, dense_layers: int, q_lora: int, kv_lora: int,
                       nope_dim: int, rope_dim: int, v_dim: int, index_heads: int, index_dim: int, index_topk: int,
                       indexer_types: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    """A GlmMoeDsaForCausalLM (GLM-5) config.json (without dtype and version): latent attention with a
    sparse-attention indexer per layer ("full", or "shared": reuses the previous full layer's pick)."""
    layers = kw["layers"]
    config = common_config("GlmMoeDsaForCausalLM", "glm_moe_dsa", kv_heads=kw["heads"], **kw) | {
        "attention_bias": False, "first_k_dense_replace": dense_layers, "head_dim": rope_dim,
        "index_head_dim": index_dim, "index_n_heads": index_heads, "index_topk": index_topk,
        "indexer_types": indexer_types or ["full"] * layers, "kv_lora_rank": kv_lora,
        "layer_types": ["indexed_attention"] * layers, "mlp_bias": False,
        "mlp_layer_types": ["dense"] * dense_layers + ["sparse"] * (layers - dense_layers),
        "moe_intermediate_size": moe_ffn, "n_group": 1, "n_routed_experts": experts, "n_shared_experts": 1,
        "norm_topk_prob": True, "num_experts_per_tok": top_k, "output_router_logits": False, "q_lora_rank": q_lora,
        "qk_head_dim": nope_dim + rope_dim, "qk_nope_head_dim": nope_dim, "qk_rope_head_dim": rope_dim,
        "routed_scaling_factor": 2.5, "topk_group": 1, "v_head_dim": v_dim,
    }
    return config


def gpt_oss_config(*, head_dim: int, experts: int, top_k: int, sliding_window: int, **kw: Any) -> dict[str, Any]:
    """A GptOssForCausalLM config.json (without dtype and version): alternating sliding and full
    attention with sinks, biased experts with the clamped SwiGLU, YaRN RoPE."""
    config = common_config("GptOssForCausalLM", "gpt_oss", **kw) | {
        "attention_bias": True, "head_dim": head_dim,
        "layer_types": ["sliding_attention", "full_attention"] * (kw["layers"] // 2) + ["sliding_attention"] * (kw["layers"] % 2),
        "num_experts_per_tok": top_k, "num_local_experts": experts, "output_router_logits": False,
        "router_aux_loss_coef": 0.001, "sliding_window": sliding_window, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
    }
    config["rope_parameters"] = {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": kw["max_pos"] // 32,
        "rope_theta": float(kw["rope_theta"]), "rope_type": "yarn", "truncate": False,
    }
    return config


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("mixtral-1.7b", "Mixtral MoE, 64 experts top-8 (the benchmark shape)", mixtral_config(
        hidden=1024, layers=16, heads=16, kv_heads=16, head_dim=64, experts=64, top_k=8, ffn=512,
        vocab=32000, rope_theta=1e6, max_pos=4096, eps=1e-5)),
    Shape("olmoe-7b", "OLMoE-1B-7B's shape, 64 experts top-8, q/k norms", olmoe_config(
        hidden=2048, layers=16, heads=16, kv_heads=16, experts=64, top_k=8, ffn=1024,
        vocab=50304, rope_theta=1e4, max_pos=4096, eps=1e-5)),
    Shape("glm5-256e", "GLM-5's experts scaled down: 256 experts top-8, latent attention, indexer",
          glm_moe_dsa_config(
              hidden=1024, layers=6, heads=16, experts=256, top_k=8, moe_ffn=256, ffn=1536, dense_layers=1,
              q_lora=512, kv_lora=512, nope_dim=192, rope_dim=64, v_dim=256, index_heads=32, index_dim=128,
              index_topk=2048, vocab=32000, rope_theta=1e6, max_pos=8192, eps=1e-5)),
    # Published shapes: config.json values of the released checkpoints (from their model cards' configs), but the
    # token ids, which are the synthetic tokenizer's, and MTP layers, which Colibri does not run (none written).
    Shape("qwen3-30b-a3b", "Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B, 2025-04 release): 128 experts top-8, 30.5 B",
          qwen3_moe_config(
              hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, moe_ffn=768, ffn=6144,
              vocab=151936, rope_theta=1e6, max_pos=40960, eps=1e-6)),
    Shape("gpt-oss-20b", "gpt-oss-20b (openai/gpt-oss-20b, 2025-08 release): 32 experts top-4, 20.9 B",
          gpt_oss_config(
              hidden=2880, layers=24, heads=64, kv_heads=8, head_dim=64, experts=32, top_k=4, ffn=2880,
              sliding_window=128, vocab=201088, rope_theta=1.5e5, max_pos=131072, eps=1e-5)),
    Shape("gpt-oss-120b", "gpt-oss-120b (openai/gpt-oss-120b, 2025-08 release): 128 experts top-4, 116.8 B",
          gpt_oss_config(
              hidden=2880, layers=36, heads=64, kv_heads=8, head_dim=64, experts=128, top_k=4, ffn=2880,
              sliding_window=128, vocab=201088, rope_theta=1.5e5, max_pos=131072, eps=1e-5)),
    Shape("glm-4.5-air", "GLM-4.5-Air (zai-org/GLM-4.5-Air, 2025-07 release): 128 experts top-8 + shared, 106 B",
          glm4_moe_config(
              hidden=4096, layers=46, heads=96, kv_heads=8, head_dim=128, experts=128, top_k=8, moe_ffn=1408,
              ffn=10944, dense_layers=1, qk_norm=False, attention_bias=True, vocab=151552, rope_theta=1e6,
              max_pos=131072, eps=1e-5)),
    Shape("qwen2.5-32b", "Qwen2.5-32B-Instruct (Qwen/Qwen2.5-32B-Instruct, 2024-09 release): dense, 32.8 B",
          qwen2_config(
              hidden=5120, layers=64, heads=40, kv_heads=8, ffn=27648, vocab=152064, rope_theta=1e6,
              max_pos=32768, eps=1e-6)),
    Shape("glm-5", "GLM-5 (zai-org/GLM-5, 2026-02 release): 256 experts top-8, latent attention, indexer, 744 B; "
          "use --layers N", glm_moe_dsa_config(
              hidden=6144, layers=78, heads=64, experts=256, top_k=8, moe_ffn=2048, ffn=12288, dense_layers=3,
              q_lora=2048, kv_lora=512, nope_dim=192, rope_dim=64, v_dim=256, index_heads=32, index_dim=128,
              index_topk=2048, vocab=154880, rope_theta=1e6, max_pos=202752, eps=1e-5)),
    *FAMILY_SHAPES,
    Shape("mixtral-tiny", "a few-MB Mixtral for tests and quick runs", mixtral_config(
        hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, experts=8, top_k=2, ffn=128,
        vocab=1024, rope_theta=1e6, max_pos=512, eps=1e-5)),
    Shape("olmoe-tiny", "a few-MB OLMoE for tests and quick runs", olmoe_config(
        hidden=128, layers=4, heads=4, kv_heads=4, experts=8, top_k=2, ffn=128,
        vocab=1024, rope_theta=1e4, max_pos=512, eps=1e-5)),
    Shape("glm4-moe-tiny", "a few-MB GLM-4.5 (sigmoid routing, shared expert, partial RoPE)", glm4_moe_config(
        hidden=128, layers=4, heads=4, kv_heads=2, experts=8, top_k=2, moe_ffn=64, ffn=256, dense_layers=1,
        vocab=1024, rope_theta=1e6, max_pos=512, eps=1e-5)),
    Shape("glm5-tiny", "a few-MB GLM-5 (latent attention, sparse-attention indexer, shared indexer layer)",
          glm_moe_dsa_config(
              hidden=128, layers=4, heads=4, experts=8, top_k=2, moe_ffn=64, ffn=256, dense_layers=1,
              q_lora=64, kv_lora=32, nope_dim=32, rope_dim=16, v_dim=32, index_heads=4, index_dim=32, index_topk=4,
              indexer_types=["full", "full", "shared", "full"], vocab=1024, rope_theta=1e4, max_pos=512, eps=1e-5)),
    Shape("gpt-oss-tiny", "a few-MB gpt-oss (sinks, sliding window, biased clamped-SwiGLU experts)", gpt_oss_config(
        hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, experts=8, top_k=2, ffn=128, sliding_window=4,
        vocab=1024, rope_theta=1.5e5, max_pos=4096, eps=1e-5)),
    Shape("llama-tiny", "a few-MB dense Llama for tests and quick runs", llama_config(
        hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, ffn=384,
        vocab=1024, rope_theta=1e4, max_pos=512, eps=1e-5)),
)}


def get_shape(name: str) -> Shape:
    """The shape called `name`, or an error listing the known ones."""
    try:
        return SHAPES[name]
    except KeyError:
        raise ColibriError(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)} (see `colibri synth --list`)") from None


def with_layers(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """The config cut to its first `layers` decoder layers: each layer keeps its published shapes and kind."""
    n = config["num_hidden_layers"]
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= n:
        raise ColibriError(f"--layers {layers!r}: choose 1 to {n} (the shape's layer count)")
    out = dict(config, num_hidden_layers=layers)
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):     # one entry per layer
        if isinstance(out.get(key), list):
            out[key] = out[key][:layers]
    if "max_window_layers" in out:
        out["max_window_layers"] = min(out["max_window_layers"], layers)
    if isinstance(out.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in out["mlp_only_layers"] if i < layers]
    return out


def config_for(shape: Shape, dtype: str, layers: int | None = None) -> dict[str, Any]:
    """The config.json dict of `shape` stored in `dtype` (its first `layers` layers), keys sorted as transformers
    writes them."""
    if dtype not in DTYPES:
        raise ColibriError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    config = shape.config if layers is None else with_layers(shape.config, layers)
    full = config | {"dtype": DTYPES[dtype][2], "transformers_version": TRANSFORMERS_FORMAT}
    return dict(sorted(full.items()))
