"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): grouped-query attention with partial RoPE (the first
`partial_rotary_factor` of each head rotates, in halves), optional per-head q/k norms and q/k/v biases,
and DeepSeek-V3's sigmoid-scored MoE (score-correction bias, group-limited top-k, routed scaling, shared
experts). The first `first_k_dense_replace` layers are dense."""

from __future__ import annotations

from typing import Any

from engine.models.config import (
    ROPE_BUFFERS,
    Config,
    dense_mlp,
    gqa_attention,
    model_fields,
    moe_counts,
    with_defaults,
)
from engine.spec import LayerSpec, ModelSpec, MoESpec

ARCHITECTURES = ("Glm4MoeForCausalLM",)

# transformers' Glm4MoeConfig defaults, for keys a config.json leaves out
DEFAULTS: dict[str, Any] = dict(
    vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46, num_attention_heads=96,
    num_key_value_heads=8, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
    tie_word_embeddings=False, attention_bias=False, moe_intermediate_size=1408, num_experts_per_tok=8,
    n_shared_experts=1, n_routed_experts=128, routed_scaling_factor=1.0, n_group=1, topk_group=1,
    first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False, num_nextn_predict_layers=1,
)
ALIASES = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}


def _rope_factor(cfg: Config) -> Config:
    """GLM rotates half of each head unless the config says otherwise (transformers' default 0.5)."""
    nested = [cfg.data.get(key) for key in ("rope_parameters", "rope_scaling")]
    if cfg.data.get("partial_rotary_factor") is None and \
            not any(isinstance(p, dict) and p.get("partial_rotary_factor") is not None for p in nested):
        return Config({**cfg.data, "partial_rotary_factor": 0.5}, cfg.source)
    return cfg


def sigmoid_moe(cfg: Config, architecture: str) -> MoESpec:
    """The sigmoid-scored, group-limited MoE block of GLM-4.5 (DeepSeek-V3's router)."""
    n_experts, top_k = cfg.req("n_routed_experts"), cfg.req("num_experts_per_tok")
    moe_counts(cfg, n_experts, top_k, "n_routed_experts")
    n_group, topk_group = cfg.req("n_group"), cfg.req("topk_group")
    cfg.require(n_experts % n_group == 0 and n_experts // n_group >= 2, "n_group", n_group,
                f"a divisor of n_routed_experts ({n_experts}) leaving at least 2 experts a group "
                "(a group ranks by its two best)")
    cfg.require(topk_group <= n_group, "topk_group", topk_group, f"at most n_group ({n_group})")
    # more picks than the kept groups hold would choose masked experts, in an order the reference leaves open
    cfg.require(top_k <= topk_group * (n_experts // n_group), "num_experts_per_tok", top_k,
                f"at most the {topk_group * (n_experts // n_group)} experts of the topk_group kept groups")
    expert_ffn = cfg.req("moe_intermediate_size")
    return MoESpec(
        n_experts=n_experts,
        top_k=top_k,
        expert_ffn=expert_ffn,
        scoring="sigmoid",
        norm_topk_prob=cfg.req("norm_topk_prob", bool),
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=cfg.req("routed_scaling_factor", float),
        correction_bias=True,
        shared_ffn=expert_ffn * cfg.req("n_shared_experts"),
        act=cfg.req("hidden_act", str),
        shared_prefix="shared_experts",
    )


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a GLM-4.5-style config.json."""
    cfg = _rope_factor(with_defaults(cfg, DEFAULTS, ALIASES))
    attn = gqa_attention(cfg, qkv_bias=cfg.req("attention_bias", bool), o_bias=False,
                         qk_norm="head" if cfg.req("use_qk_norm", bool) else None)
    moe = sigmoid_moe(cfg, architecture)
    n, first_dense = cfg.req("num_hidden_layers"), cfg.req("first_k_dense_replace")
    dense = dense_mlp(cfg, moe.act) if first_dense else None
    layers = tuple(LayerSpec(attn, dense if i < first_dense else moe) for i in range(n))
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg))


def mtp_and_empty_shared(cfg: Config) -> tuple[str, ...]:
    """The patterns of the MTP layers (numbered from num_hidden_layers on) and of the zero-width shared
    expert transformers saves when `n_shared_experts` is 0; both unread by next-token decoding."""
    n, mtp = cfg.req("num_hidden_layers"), cfg.req("num_nextn_predict_layers")
    cfg.require(mtp <= n, "num_nextn_predict_layers", mtp, f"at most num_hidden_layers ({n})")
    layers = "|".join(str(i) for i in range(n, n + mtp))
    patterns = (rf"model\.layers\.(?:{layers})\..+",) if mtp else ()
    if cfg.req("n_shared_experts") == 0:
        patterns += (r"model\.layers\.\d+\.mlp\.shared_experts\.(?:gate|up|down)_proj\.weight",)
    return ROPE_BUFFERS + patterns


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints carry that the model does not read: the MTP layers (GLM-4.5 ships one,
    `model.layers.46.*` / `92.*`, read only by the MTP drafter, `--speculative mtp`) and an empty shared
    expert."""
    return mtp_and_empty_shared(with_defaults(cfg, DEFAULTS, ALIASES))


def mtp_spec(cfg: Config, architecture: str) -> ModelSpec | None:
    """The one-layer spec of the MTP module's decoder layer (a routed layer), or None without MTP layers."""
    from engine.models.deepseek import mtp_layer_spec

    return mtp_layer_spec(spec_from_config(cfg, architecture), with_defaults(cfg, DEFAULTS, ALIASES))
