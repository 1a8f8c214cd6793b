"""MiniMax-M2 (M2, M2.1, M2.5): attention with RMSNorms over the whole q and k projections and partial RoPE
(`rotary_dim`), and in every layer a sigmoid-scored MoE (`block_sparse_moe`, w1/w3/w2 experts) that chooses by
score + `e_score_correction_bias` and renormalises the chosen scores.

The released config.json carries keys of MiniMax's own code that transformers does not read (`use_qk_norm`,
`qk_norm_type`, `scoring_func`, `shared_intermediate_size`, `attn_type_list`, `sliding_window`): each is checked
to mean what the reference computes, and a value asking for something else is refused.
"""

from __future__ import annotations

from engine.models.config import ROPE_BUFFERS, Config, gqa_attention, model_fields, moe_counts, with_defaults
from engine.spec import LayerSpec, ModelSpec, MoESpec

ARCHITECTURES = ("MiniMaxM2ForCausalLM",)

# MiniMaxM2Config's defaults, for keys a config.json leaves out
DEFAULTS = {
    "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
    "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 196608, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "num_experts_per_tok": 8,
    "rope_theta": 5000000.0,      # read after rope_parameters' own rope_theta, as the reference does
}


def _check_original_keys(cfg: Config, n_layers: int) -> None:
    """Refuse the values of MiniMax's own config keys that ask for what the reference does not compute."""
    cfg.require(cfg.opt("use_qk_norm", True, bool), "use_qk_norm", False,
                "true: the reference always normalises q and k (MiniMax-M2 checkpoints carry q_norm and k_norm)")
    norm_type = cfg.opt("qk_norm_type", "per_layer", str)
    cfg.require(norm_type == "per_layer", "qk_norm_type", norm_type,
                "'per_layer' (one RMSNorm over all heads' q, one over all k), the only kind MiniMax-M2 runs")
    scoring = cfg.opt("scoring_func", "sigmoid", str)
    cfg.require(scoring == "sigmoid", "scoring_func", scoring, "'sigmoid', the only router scoring MiniMax-M2 runs")
    shared = cfg.opt("shared_intermediate_size", 0, int)
    cfg.require(shared == 0, "shared_intermediate_size", shared, "0: MiniMax-M2 has no shared expert")
    window = cfg.opt("sliding_window", 0, int)
    cfg.require(window == 0, "sliding_window", window, "null: every MiniMax-M2 layer attends to all positions")
    kinds = cfg.opt("attn_type_list", None, list)
    if kinds is not None:
        cfg.require(len(kinds) == n_layers and all(k == 1 and not isinstance(k, bool) for k in kinds),
                    "attn_type_list", kinds, f"{n_layers} entries of 1 (softmax attention; 0, linear "
                    "attention, is MiniMax-01's and not run here)")


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a MiniMax-M2 config.json."""
    cfg = with_defaults(cfg, DEFAULTS)
    if "rotary_dim" in cfg.data and cfg.data.get("partial_rotary_factor") is None:
        # the released checkpoints give the rotated features as `rotary_dim`; rope_parameters'
        # partial_rotary_factor, then a top-level one, take precedence as in the reference
        rotary, head_dim = cfg.req("rotary_dim"), cfg.req("head_dim")
        cfg.require(0 < rotary <= head_dim, "rotary_dim", rotary, f"a size within head_dim {head_dim}")
        cfg = with_defaults(cfg, {"partial_rotary_factor": rotary / head_dim})
    n = cfg.req("num_hidden_layers")
    _check_original_keys(cfg, n)
    n_experts, top_k = cfg.first(("num_local_experts", "num_experts"), int, 256), cfg.req("num_experts_per_tok")
    moe_counts(cfg, n_experts, top_k, "num_local_experts")
    moe = MoESpec(
        n_experts=n_experts,
        top_k=top_k,
        expert_ffn=cfg.req("intermediate_size"),
        scoring="sigmoid",
        norm_topk_prob=True,                      # the reference always renormalises the chosen scores
        correction_bias=cfg.opt("use_routing_bias", True, bool),
        bias_name="e_score_correction_bias",      # beside the router, not inside it
        act=cfg.opt("hidden_act", "silu", str),
        prefix="block_sparse_moe",
        proj_names=("w1", "w3", "w2"),
    )
    attn = gqa_attention(cfg, qkv_bias=False, o_bias=False, qk_norm="full")
    layers = tuple(LayerSpec(attn, moe) for _ in range(n))
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg))


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read."""
    return ROPE_BUFFERS
