"""GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's latent attention (interleaved RoPE unless
`rope_interleave` is false) and GLM-4.5's sigmoid-scored MoE, with dense and routed layers placed by
`mlp_layer_types`."""

from __future__ import annotations

from typing import Any

from engine.models.config import Config, dense_mlp, model_fields, with_defaults
from engine.models.deepseek_v2 import latent_attention
from engine.models.glm4_moe import mtp_and_empty_shared, sigmoid_moe
from engine.spec import LayerSpec, ModelSpec

ARCHITECTURES = ("Glm4MoeLiteForCausalLM",)

# transformers' Glm4MoeLiteConfig defaults, for keys a config.json leaves out (q_lora_rank: an explicit null
# means no query low-rank); transformers skips one MTP layer after the last whatever the config counts
DEFAULTS: dict[str, Any] = dict(
    vocab_size=154880, hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536, num_hidden_layers=47,
    num_attention_heads=20, n_shared_experts=1, n_routed_experts=64, routed_scaling_factor=1.8, kv_lora_rank=512,
    q_lora_rank=768, qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1,
    num_experts_per_tok=4, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=202752, rms_norm_eps=1e-5,
    bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, rope_interleave=True, attention_bias=False,
    num_nextn_predict_layers=1,
)
ALIASES = {"num_local_experts": "n_routed_experts"}
KINDS = ("dense", "sparse")


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a GLM-4.7-Flash-style config.json."""
    cfg = with_defaults(cfg, DEFAULTS, ALIASES)
    attn = latent_attention(cfg, interleaved=cfg.req("rope_interleave", bool))
    # the reference rotates the whole rope slice with tables of the partial width: refuse a partial factor
    cfg.require(attn.rope.dim == attn.qk_rope_dim, "partial_rotary_factor", attn.rope.dim / attn.qk_rope_dim,
                "1 (the whole qk_rope_head_dim rotates)")
    moe = sigmoid_moe(cfg, architecture)
    n = cfg.req("num_hidden_layers")
    kinds = cfg.opt("mlp_layer_types", ["dense"] + ["sparse"] * (n - 1), list)
    cfg.require(len(kinds) == n and all(k in KINDS for k in kinds), "mlp_layer_types", kinds,
                f"a list of {n} entries, each 'dense' or 'sparse'")
    dense = dense_mlp(cfg, moe.act) if "dense" in kinds else None
    layers = tuple(LayerSpec(attn, dense if kind == "dense" else moe) for kind in kinds)
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg))


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints carry that the model does not read: the MTP layers (`model.layers.47.*` in
    GLM-4.7-Flash) and the zero-width shared expert transformers saves when `n_shared_experts` is 0."""
    return mtp_and_empty_shared(with_defaults(cfg, DEFAULTS, ALIASES))
