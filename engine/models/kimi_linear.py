"""Kimi Linear: Kimi delta attention layers (engine/blocks/kda.py) between multi-head latent attention layers,
and DeepSeek-V3's sigmoid-routed MoE with shared experts.

The latent attention is DeepSeek's without any rotation (NoPE): the `qk_rope_head_dim` part of the keys is
still the shared one from `kv_a_proj_with_mqa`, left as it is, and scores are scaled by qk_head_dim^-0.5 alone.
`layer_types` (or `linear_attn_config`'s 1-indexed `full_attn_layers` / `kda_layers`, or every 4th layer from
the 5th full) says which layers are which; `mlp_layer_types` (or `first_k_dense_replace`, 1) which are dense.
Norms are plain RMSNorms (weight times the normed input). The output head is never tied to the embedding.
Checkpoints keep the routed experts as Mixtral's `block_sparse_moe.experts.{e}.w1/w2/w3`, the dense layers'
MLP under `mlp.` (or, as transformers saves it, `block_sparse_moe.`), and the convolutions of q, k and v apart.
"""

from __future__ import annotations

from engine.blocks.norm import ACTIVATIONS
from engine.formats.fused import FusedTensor, Piece
from engine.models.config import ROPE_BUFFERS, Config, model_fields, moe_counts, with_defaults
from engine.spec import KimiDeltaSpec, LayerSpec, MLASpec, MLPSpec, ModelSpec, MoESpec, RopeSpec

ARCHITECTURES = ("KimiLinearForCausalLM",)
LAYER_TYPES = ("linear_attention", "full_attention")
MLP_TYPES = ("dense", "sparse")

# KimiLinearConfig's defaults for the keys a config.json leaves out
DEFAULTS = dict(
    vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27,
    num_attention_heads=32, n_shared_experts=1, routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=8,
    norm_topk_prob=True, hidden_act="silu", max_position_embeddings=1048576, rms_norm_eps=1e-5,
    bos_token_id=163584, eos_token_id=163586, tie_word_embeddings=False, attention_bias=False,
    num_local_experts=256, linear_head_dim=128, linear_num_heads=32, linear_conv_kernel_dim=4,
)
# transformers' attribute_map: config.json files spell these keys the other way
ALIASES = {"model_max_length": "max_position_embeddings", "moe_renormalize": "norm_topk_prob",
           "num_expert_group": "n_group", "num_experts": "num_local_experts",
           "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts"}
# linear_attn_config's keys, which win over the top-level ones
LINEAR_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
               "short_conv_kernel_size": "linear_conv_kernel_dim"}


def _config(cfg: Config) -> Config:
    """The config with the reference's defaults, aliases and `linear_attn_config` read in."""
    linear = cfg.data.get("linear_attn_config") or {}
    cfg.require(isinstance(linear, dict), "linear_attn_config", linear, "an object")
    cfg = with_defaults(cfg, DEFAULTS, ALIASES)
    return Config({**cfg.data, **{key: linear[k] for k, key in LINEAR_KEYS.items() if k in linear}}, cfg.source)


def layer_types(cfg: Config, n: int) -> list[str]:
    """Each layer's token mixer: `layer_types`, else `linear_attn_config`'s 1-indexed lists, else every 4th
    layer from index 4 full."""
    types = cfg.opt("layer_types", None, list)
    linear = cfg.data.get("linear_attn_config") or {}
    if types is None and "full_attn_layers" in linear and "kda_layers" in linear:
        full, kda = linear["full_attn_layers"], linear["kda_layers"]
        ok = all(isinstance(x, list) and all(isinstance(i, int) and 1 <= i <= n for i in x) for x in (full, kda))
        cfg.require(ok and sorted(full + kda) == list(range(1, n + 1)), "linear_attn_config", linear,
                    f"full_attn_layers and kda_layers naming each of the layers 1..{n} once")
        types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
    if types is None:
        return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    cfg.require(len(types) == n and all(t in LAYER_TYPES for t in types), "layer_types", types,
                f"{n} entries among {', '.join(LAYER_TYPES)}")
    return types


def mlp_types(cfg: Config, n: int) -> list[str]:
    """Each layer's feed-forward: `mlp_layer_types`, else the first `first_k_dense_replace` (1) dense."""
    types = cfg.opt("mlp_layer_types", None, list)
    if types is None:
        first = cfg.opt("first_k_dense_replace", 1, int)
        return ["dense" if i < first else "sparse" for i in range(n)]
    cfg.require(len(types) == n and all(t in MLP_TYPES for t in types), "mlp_layer_types", types,
                f"{n} entries among {', '.join(MLP_TYPES)}")
    return types


def kda(cfg: Config) -> KimiDeltaSpec:
    """The Kimi delta attention of a config (`linear_*` keys or `linear_attn_config`)."""
    heads, dim = cfg.req("linear_num_heads"), cfg.req("linear_head_dim")
    taps = cfg.req("linear_conv_kernel_dim")
    for key, value in (("linear_num_heads", heads), ("linear_head_dim", dim), ("linear_conv_kernel_dim", taps)):
        cfg.require(value >= 1, key, value, "an integer >= 1")
    return KimiDeltaSpec(n_k_heads=heads, n_v_heads=heads, k_head_dim=dim, v_head_dim=dim, conv_kernel=taps,
                         act=cfg.opt("hidden_act", "silu", str), rms_eps=cfg.opt("rms_norm_eps", 1e-5, float))


def latent_attention(cfg: Config) -> MLASpec:
    """The latent attention of a config: DeepSeek's, with no rotation and the plain qk_head_dim^-0.5 scale."""
    heads = cfg.req("num_attention_heads")
    kv_heads = cfg.opt("num_key_value_heads", heads, int)
    # the reference repeats the per-head keys by heads / kv_heads: only 1 gives scores of matching shape
    cfg.require(kv_heads == heads, "num_key_value_heads", kv_heads, f"num_attention_heads ({heads}) or absent")
    nope, rope_dim = cfg.req("qk_nope_head_dim"), cfg.req("qk_rope_head_dim")
    cfg.require(rope_dim % 2 == 0, "qk_rope_head_dim", rope_dim, "an even number")
    return MLASpec(
        n_heads=heads, q_lora_rank=cfg.opt("q_lora_rank", None, int), kv_lora_rank=cfg.req("kv_lora_rank"),
        qk_nope_dim=nope, qk_rope_dim=rope_dim, v_head_dim=cfg.req("v_head_dim"),
        rope=RopeSpec(dim=rope_dim, theta=1.0, kind="none"), scale=(nope + rope_dim) ** -0.5,
        bias=cfg.opt("attention_bias", False, bool), norm_eps=1e-6,   # q_a / kv_a norms: RMSNorm's default eps
    )


# keys of the published config.json (Moonshot's own code) that transformers does not read: it runs them as these
# values say, so any other value would be run wrong
FIXED = {"mla_use_nope": True, "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1}


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a Kimi Linear config.json (keys it leaves out take transformers' defaults)."""
    cfg = _config(cfg)
    for key, value in FIXED.items():
        got = cfg.data.get(key, value)
        cfg.require(got == value and type(got) is type(value), key, got, f"{value!r} (the only one implemented)")
    n = cfg.req("num_hidden_layers")
    types, ffns = layer_types(cfg, n), mlp_types(cfg, n)
    act = cfg.opt("hidden_act", "silu", str)
    # the convolution's and the MLPs' activation: refused at open, not at the first token
    cfg.require(act in ACTIVATIONS, "hidden_act", act, f"one of {', '.join(sorted(ACTIVATIONS))}")
    linear = kda(cfg) if "linear_attention" in types else None
    full = latent_attention(cfg) if "full_attention" in types else None
    moe = None
    if "sparse" in ffns:
        n_experts, top_k = cfg.req("num_local_experts"), cfg.req("num_experts_per_tok")
        moe_counts(cfg, n_experts, top_k, "num_experts")
        n_group = cfg.opt("n_group", 1, int)
        cfg.require(n_experts % n_group == 0 and n_experts // n_group >= 2, "num_expert_group", n_group,
                    f"a divisor of the {n_experts} experts leaving at least 2 per group")
        topk_group = cfg.opt("topk_group", 1, int)
        cfg.require(topk_group <= n_group, "topk_group", topk_group, f"at most num_expert_group ({n_group})")
        expert_ffn = cfg.req("moe_intermediate_size")
        moe = MoESpec(
            n_experts=n_experts, top_k=top_k, expert_ffn=expert_ffn, scoring="sigmoid",
            norm_topk_prob=cfg.opt("norm_topk_prob", True, bool), n_group=n_group, topk_group=topk_group,
            routed_scaling_factor=cfg.opt("routed_scaling_factor", 1.0, float), correction_bias=True,
            shared_ffn=expert_ffn * cfg.opt("n_shared_experts", 0, int), act=act, prefix="block_sparse_moe",
            proj_names=("w1", "w3", "w2"), shared_prefix="shared_experts",
        )
    dense = None
    if "dense" in ffns:
        size = cfg.req("intermediate_size")
        cfg.require(size > 0, "intermediate_size", size, "a positive size for the dense layers")
        dense = MLPSpec(intermediate=size, act=act)
    layers = tuple(LayerSpec(linear if t == "linear_attention" else full, moe if f == "sparse" else dense)
                   for t, f in zip(types, ffns))
    # the reference never ties its head (no tied-weight keys), whatever tie_word_embeddings says: lm_head is read
    return ModelSpec(architecture=architecture, layers=layers, **{**model_fields(cfg), "tie_embeddings": False})


def fused_tensors(cfg: Config) -> tuple[FusedTensor, ...]:
    """The dense layers' MLP as transformers saves it (under `block_sparse_moe.`), renamed to `mlp.`."""
    return (FusedTensor(r"model\.layers\.(\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.weight",
                        (Piece(r"model.layers.\1.mlp.\2.weight"),)),)


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read: with `n_shared_experts` 0, the reference's
    empty shared experts (intermediate size 0)."""
    if _config(cfg).opt("n_shared_experts", 1, int) == 0:
        return ROPE_BUFFERS + (r"model\.layers\.\d+\.block_sparse_moe\.shared_experts\..+",)
    return ROPE_BUFFERS
