"""DeepSeek-V3: multi-head latent attention with decoupled RoPE, and a sigmoid-scored MoE with
group-limited routing, a score-correction bias, routed scaling and shared experts. The first
`first_k_dense_replace` layers are dense."""

from __future__ import annotations

import dataclasses
import math

from engine.errors import ModelFormatError
from engine.models.config import (
    ROPE_BUFFERS,
    Config,
    dense_mlp,
    model_fields,
    moe_counts,
    rope_from_config,
    with_defaults,
)
from engine.spec import LayerSpec, MLASpec, MLPSpec, ModelSpec, MoESpec

ARCHITECTURES = ("DeepseekV3ForCausalLM",)

# transformers' DeepseekV3Config defaults, for keys a config.json leaves out (q_lora_rank: an explicit null
# means no query low-rank, a missing key the default rank); MTP layers are allowed only where a config counts them
DEFAULTS = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
    q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu",
    max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    rope_interleave=True, attention_bias=False,
)
ALIASES = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}


def _softmax_scale(qk_head_dim: int, rope) -> float:
    """head_dim^-0.5, times YaRN's mscale^2 where a scaled RoPE (of any type, as transformers'
    `yarn_apply_mscale`) sets mscale_all_dim."""
    scale = qk_head_dim**-0.5
    if rope.kind != "default" and rope.mscale_all_dim and rope.factor > 1:
        m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= m * m
    return scale


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a DeepSeek-V3 config.json (keys it leaves out take transformers' defaults)."""
    cfg = with_defaults(cfg, DEFAULTS, ALIASES)
    scoring = cfg.opt("scoring_func", "sigmoid", str)
    if scoring != "sigmoid":
        raise ModelFormatError(f"{cfg.source}: scoring_func {scoring!r} is not supported for {architecture} (only sigmoid)")
    rope_dim = cfg.req("qk_rope_head_dim")
    rope = rope_from_config(cfg, rope_dim, interleaved=cfg.opt("rope_interleave", True, bool))
    nope, q_lora = cfg.req("qk_nope_head_dim"), cfg.opt("q_lora_rank", None, int)
    attn = MLASpec(
        n_heads=cfg.req("num_attention_heads"),
        q_lora_rank=q_lora,
        kv_lora_rank=cfg.req("kv_lora_rank"),
        qk_nope_dim=nope,
        qk_rope_dim=rope_dim,
        v_head_dim=cfg.req("v_head_dim"),
        rope=rope,
        scale=_softmax_scale(nope + rope_dim, rope),
        bias=cfg.opt("attention_bias", False, bool),
        norm_eps=1e-6,                    # q_a_layernorm, kv_a_layernorm: RMSNorm's default, not rms_norm_eps
    )
    act = cfg.opt("hidden_act", "silu", str)
    n_experts, expert_ffn = cfg.first(("n_routed_experts", "num_local_experts")), cfg.req("moe_intermediate_size")
    n_group, top_k = cfg.opt("n_group", 1, int), cfg.req("num_experts_per_tok")
    moe_counts(cfg, n_experts, top_k, "n_routed_experts")
    if n_experts % n_group:
        raise ModelFormatError(f"{cfg.source}: n_routed_experts {n_experts} is not a multiple of n_group {n_group}")
    topk_group = cfg.opt("topk_group", 1, int)
    cfg.require(topk_group <= n_group, "topk_group", topk_group, f"at most n_group ({n_group})")
    moe = MoESpec(
        n_experts=n_experts,
        top_k=top_k,
        expert_ffn=expert_ffn,
        scoring="sigmoid",
        norm_topk_prob=cfg.opt("norm_topk_prob", True, bool),
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=cfg.opt("routed_scaling_factor", 1.0, float),
        correction_bias=True,
        shared_ffn=expert_ffn * cfg.opt("n_shared_experts", 0, int),
        act=act,
        shared_prefix="shared_experts",
    )
    first_dense = cfg.opt("first_k_dense_replace", 0, int)
    n = cfg.req("num_hidden_layers")
    dense = dense_mlp(cfg, act) if first_dense else MLPSpec(intermediate=cfg.req("intermediate_size"), act=act)
    layers = tuple(LayerSpec(attn, dense if i < first_dense else moe) for i in range(n))
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg))


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints carry that the model does not read: the multi-token-prediction layers.

    DeepSeek-V3 ships `num_nextn_predict_layers` MTP modules as layers numbered from `num_hidden_layers` on
    (`model.layers.61.*`: their own embedding, norms, projection and decoder layer), used for speculative
    training, not by next-token decoding.
    """
    cfg = with_defaults(cfg, DEFAULTS, ALIASES)
    n, mtp = cfg.req("num_hidden_layers"), cfg.opt("num_nextn_predict_layers", 0, int)
    cfg.require(mtp <= n, "num_nextn_predict_layers", mtp, f"at most num_hidden_layers ({n})")
    layers = "|".join(str(i) for i in range(n, n + mtp))
    return ROPE_BUFFERS + ((rf"model\.layers\.(?:{layers})\..+",) if mtp else ())


def mtp_spec(cfg: Config, architecture: str) -> ModelSpec | None:
    """The one-layer spec of the first MTP module's decoder layer (the routed layer's attention and MoE), or
    None when the config counts no MTP layers (`num_nextn_predict_layers`)."""
    return mtp_layer_spec(spec_from_config(cfg, architecture), with_defaults(cfg, DEFAULTS, ALIASES))


def mtp_layer_spec(main: ModelSpec, cfg: Config) -> ModelSpec | None:
    """`main` cut down to the decoder layer its MTP modules carry (the last routed layer's shape), or None
    without MTP layers. Shared by the DeepSeek-V3-shaped families (GLM-4.5, GLM-5)."""
    n, mtp = cfg.req("num_hidden_layers"), cfg.opt("num_nextn_predict_layers", 0, int)
    cfg.require(0 <= mtp <= n, "num_nextn_predict_layers", mtp, f"from 0 to num_hidden_layers ({n})")
    if not mtp:
        return None
    routed = [ls for ls in main.layers if isinstance(ls.ffn, MoESpec)] or list(main.layers)
    layer = routed[-1]
    attn = layer.attn
    if isinstance(attn, MLASpec) and attn.indexer is not None and attn.indexer.shared:
        # an MTP layer has its own indexer: there is no earlier layer of its own to share one with
        layer = dataclasses.replace(layer, attn=dataclasses.replace(
            attn, indexer=dataclasses.replace(attn.indexer, shared=False, source=None)))
    return dataclasses.replace(main, layers=(layer,))
