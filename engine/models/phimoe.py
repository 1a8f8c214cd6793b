"""Phi-3.5-MoE (PhimoeForCausalLM): LayerNorms with biases (input, post-attention, final), attention with
optional biases and an optional sliding window on every layer, an output head with an optional bias, and in
every layer a MoE of w1/w3/w2 experts (`block_sparse_moe`) routed by the sparse mixer: always two experts
(whatever `num_experts_per_tok` says, as in the reference), each weighted by a softmax over the experts near it
(`router_jitter_noise` sets how near; at inference it is that threshold, not noise), see
engine.blocks.ffn.sparsemixer.

RoPE is the default one or LongRoPE. As the reference computes it, LongRoPE takes the short factors at every
length and scales cos and sin by `short_mscale` up to `original_max_position_embeddings` tokens and by
`long_mscale` beyond, over the whole sequence at once: a cache of keys cannot follow that switch, so configs
whose two scales differ are refused (Phi-3.5-MoE's own are equal).
"""

from __future__ import annotations

import dataclasses

from engine.errors import ModelFormatError
from engine.models.config import (
    ROPE_BUFFERS,
    Config,
    gqa_attention,
    longrope_from_config,
    model_fields,
    rope_from_config,
    rope_params,
    with_defaults,
)
from engine.spec import LayerSpec, ModelSpec, MoESpec, RopeSpec

ARCHITECTURES = ("PhimoeForCausalLM", "PhiMoEForCausalLM")   # transformers; the released checkpoints

# PhimoeConfig's defaults, for keys a config.json leaves out
DEFAULTS = {
    "vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 6400, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 1000000.0, "num_experts_per_tok": 2,
    "num_local_experts": 16, "router_jitter_noise": 0.01,
}


def _rope(cfg: Config, head_dim: int) -> RopeSpec:
    """The default RoPE over the whole head, or LongRoPE at its short factors and scale."""
    params = rope_params(cfg)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        rope = rope_from_config(cfg, head_dim)
        cfg.require(rope.dim == head_dim, "partial_rotary_factor", rope.dim / head_dim,
                    "1 (or unset): PhiMoE's default RoPE rotates every feature of a head")
        return rope
    if kind != "longrope":
        raise ModelFormatError(f"{cfg.source}: rope type {kind!r} is not supported for PhiMoE (supported: default, "
                               "longrope)")
    rope, _ = longrope_from_config(cfg, head_dim, 1000000.0)     # the short factors serve every length here
    scales = Config(params, cfg.source)
    short, long = scales.req("short_mscale", float), scales.req("long_mscale", float)
    scales.require(short == long, "long_mscale", long,
                   f"short_mscale's {short}: the reference rescales every position when a sequence passes "
                   f"{rope.original_max_position} tokens, which a cache of keys cannot follow")
    return dataclasses.replace(rope, attention_factor=short)


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a Phi-3.5-MoE config.json."""
    cfg = with_defaults(cfg, DEFAULTS)     # a null num_key_value_heads stays null: multi-head, as the reference
    n_experts = cfg.first(("num_local_experts", "num_experts"))
    # the reference's sparse mixer picks two experts whatever num_experts_per_tok says (it reads the value and
    # does not use it): checked as a count, then routed as the reference routes
    cfg.req("num_experts_per_tok")
    cfg.require(n_experts >= 2, "num_local_experts", n_experts, "at least the two experts the sparse mixer picks")
    jitter = cfg.opt("router_jitter_noise", 0.01, float)
    cfg.require(jitter >= 0, "router_jitter_noise", jitter, "a threshold >= 0")
    moe = MoESpec(
        n_experts=n_experts,
        top_k=2,
        expert_ffn=cfg.req("intermediate_size"),
        scoring="sparsemixer",
        norm_topk_prob=False,
        jitter_eps=jitter,
        act=cfg.opt("hidden_act", "silu", str),
        prefix="block_sparse_moe",
        proj_names=("w1", "w3", "w2"),
    )
    window = cfg.opt("sliding_window", None, int)
    cfg.require(window is None or window >= 1, "sliding_window", window, "a window of positions >= 1, or null")
    bias = cfg.opt("attention_bias", False, bool)
    # heads and sizes as usual; the RoPE read here (gqa_attention's reader knows no LongRoPE)
    plain = Config({k: v for k, v in cfg.data.items() if k not in ("rope_scaling", "rope_parameters")}, cfg.source)
    attn = gqa_attention(plain, qkv_bias=bias, o_bias=bias, sliding_window=window)
    attn = dataclasses.replace(attn, rope=_rope(cfg, attn.head_dim))
    layers = tuple(LayerSpec(attn, moe) for _ in range(cfg.req("num_hidden_layers")))
    return ModelSpec(architecture=architecture, layers=layers, norm="layer",
                     lm_head_bias=cfg.opt("lm_head_bias", False, bool), **model_fields(cfg))


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read."""
    return ROPE_BUFFERS
