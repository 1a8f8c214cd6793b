"""DeepSeek-V2 and V2-Lite: multi-head latent attention (with or without a query low-rank) whose RoPE
rotates interleaved pairs, and a softmax-scored MoE routed greedily or group-limited (each group ranked
by its best expert, unlike V3's two best), with routed scaling and shared experts. The first
`first_k_dense_replace` layers are dense."""

from __future__ import annotations

from typing import Any

from engine.models.config import Config, dense_mlp, model_fields, moe_counts, rope_from_config, with_defaults
from engine.models.deepseek import _softmax_scale
from engine.models.glm4_moe import mtp_and_empty_shared
from engine.spec import LayerSpec, MLASpec, ModelSpec, MoESpec

ARCHITECTURES = ("DeepseekV2ForCausalLM",)

# transformers' DeepseekV2Config defaults, for keys a config.json leaves out (q_lora_rank: an explicit null
# means no query low-rank, a missing key the default rank)
DEFAULTS: dict[str, Any] = dict(
    vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, first_k_dense_replace=0, kv_lora_rank=512,
    q_lora_rank=1536, n_routed_experts=64, n_shared_experts=2, qk_nope_head_dim=128, qk_rope_head_dim=64,
    routed_scaling_factor=1.0, topk_method="greedy", norm_topk_prob=False, v_head_dim=128,
    moe_intermediate_size=1407, scoring_func="softmax", moe_layer_freq=1, num_nextn_predict_layers=0,
)
ALIASES = {"num_experts": "n_routed_experts"}
TOPK_METHODS = ("greedy", "group_limited_greedy")
LATENT_EPS = 1e-6     # q_a_layernorm and kv_a_layernorm keep RMSNorm's default eps, whatever rms_norm_eps says


def latent_attention(cfg: Config, interleaved: bool) -> MLASpec:
    """The MLA block of a DeepSeek-style config; its RoPE covers the `qk_rope_head_dim` features."""
    rope_dim, nope = cfg.req("qk_rope_head_dim"), cfg.req("qk_nope_head_dim")
    rope = rope_from_config(cfg, rope_dim, interleaved=interleaved)
    return MLASpec(
        n_heads=cfg.req("num_attention_heads"),
        q_lora_rank=cfg.opt("q_lora_rank", None, int),
        kv_lora_rank=cfg.req("kv_lora_rank"),
        qk_nope_dim=nope,
        qk_rope_dim=rope_dim,
        v_head_dim=cfg.req("v_head_dim"),
        rope=rope,
        scale=_softmax_scale(nope + rope_dim, rope),     # V3's: the same in transformers
        bias=cfg.req("attention_bias", bool),
        norm_eps=LATENT_EPS,
    )


def _moe(cfg: Config, architecture: str) -> MoESpec:
    scoring = cfg.req("scoring_func", str)
    cfg.require(scoring == "softmax", "scoring_func", scoring, f"'softmax' ({architecture} scores experts so)")
    method = cfg.req("topk_method", str)
    cfg.require(method in TOPK_METHODS, "topk_method", method, f"one of {', '.join(TOPK_METHODS)}")
    n_experts, top_k = cfg.req("n_routed_experts"), cfg.req("num_experts_per_tok")
    moe_counts(cfg, n_experts, top_k, "n_routed_experts")
    # DeepSeek's own code renormalises the top-k (and then skips the routed scaling) where transformers
    # scales and never renormalises: the two agree only with one expert a token or norm_topk_prob false
    norm = cfg.req("norm_topk_prob", bool)
    cfg.require(not norm or top_k == 1, "norm_topk_prob", norm,
                "false (DeepSeek's code and transformers disagree on renormalising the chosen experts)")
    n_group = topk_group = 1
    if method == "group_limited_greedy":
        n_group, topk_group = cfg.req("n_group"), cfg.req("topk_group")
        cfg.require(n_experts % n_group == 0, "n_group", n_group, f"a divisor of n_routed_experts ({n_experts})")
        cfg.require(topk_group <= n_group, "topk_group", topk_group, f"at most n_group ({n_group})")
        # the reference zeroes the other groups' scores: more picks than the kept groups hold would choose
        # zero-weight experts in an order it leaves open
        cfg.require(top_k <= topk_group * (n_experts // n_group), "num_experts_per_tok", top_k,
                    f"at most the {topk_group * (n_experts // n_group)} experts of the topk_group kept groups")
    expert_ffn = cfg.req("moe_intermediate_size")
    return MoESpec(
        n_experts=n_experts,
        top_k=top_k,
        expert_ffn=expert_ffn,
        scoring="softmax",
        norm_topk_prob=False,
        n_group=n_group,
        topk_group=topk_group,
        group_score="max",
        routed_scaling_factor=cfg.req("routed_scaling_factor", float),
        shared_ffn=expert_ffn * cfg.req("n_shared_experts"),
        act=cfg.req("hidden_act", str),
        shared_prefix="shared_experts",
    )


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a DeepSeek-V2 (or V2-Lite) config.json."""
    cfg = with_defaults(cfg, DEFAULTS, ALIASES)
    cfg.require(not cfg.req("mlp_bias", bool), "mlp_bias", True, "false (biases on the MLPs are not implemented)")
    freq = cfg.req("moe_layer_freq")
    cfg.require(freq == 1, "moe_layer_freq", freq, "1 (every layer after the dense ones routed; as transformers)")
    attn = latent_attention(cfg, interleaved=True)
    # transformers' default RoPE ignores partial_rotary_factor here while its scaled ones apply it: refuse it
    cfg.require(attn.rope.dim == attn.qk_rope_dim, "partial_rotary_factor", attn.rope.dim / attn.qk_rope_dim,
                "1 (the whole qk_rope_head_dim rotates)")
    moe = _moe(cfg, architecture)
    n, first_dense = cfg.req("num_hidden_layers"), cfg.req("first_k_dense_replace")
    dense = dense_mlp(cfg, moe.act) if first_dense else None
    layers = tuple(LayerSpec(attn, dense if i < first_dense else moe) for i in range(n))
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg))


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read: MTP layers where a config declares
    them, and the zero-width shared expert transformers saves when `n_shared_experts` is 0."""
    return mtp_and_empty_shared(with_defaults(cfg, DEFAULTS, ALIASES))
