"""Qwen3-Next: gated DeltaNet layers (a recurrent state per sequence) between gated full-attention layers,
and a softmax-routed MoE with a sigmoid-gated shared expert.

`layer_types` (or `full_attention_interval`) says which layers are `linear_attention` and which
`full_attention`; full attention gates each head's output with a sigmoid of a second half of q_proj,
rotates a part of each head (`partial_rotary_factor`, 0.25 by default) and norms q and k per head. Every
RMSNorm but DeltaNet's gated one is zero-centred: it multiplies by (1 + w). Which layers are sparse follows
`decoder_sparse_step` and `mlp_only_layers` as in Qwen2-MoE.
"""

from __future__ import annotations

import dataclasses

from engine.models.config import ROPE_BUFFERS, Config, dense_mlp, gqa_attention, model_fields, moe_counts
from engine.spec import GatedDeltaNetSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec

ARCHITECTURES = ("Qwen3NextForCausalLM",)
LAYER_TYPES = ("linear_attention", "full_attention")

# the reference configuration's defaults (Qwen3NextConfig), where they differ from what the shared readers assume
DEFAULTS = {
    "head_dim": 256, "num_key_value_heads": 2, "intermediate_size": 5632, "hidden_act": "silu",
    "max_position_embeddings": 32768, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10,
    "num_experts": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
}


def _with_defaults(cfg: Config) -> Config:
    """The config with the reference's defaults filled in (a partial rotary factor of 0.25 among them)."""
    data = {**DEFAULTS, **{k: v for k, v in cfg.data.items() if v is not None}}
    rope = data.get("rope_parameters") if isinstance(data.get("rope_parameters"), dict) else {}
    if "partial_rotary_factor" not in data and "partial_rotary_factor" not in rope:
        data["partial_rotary_factor"] = 0.25
    return Config(data, cfg.source)


def layer_types(cfg: Config, n: int) -> list[str]:
    """Each layer's token mixer: `layer_types`, else every `full_attention_interval`-th layer full (4)."""
    types = cfg.opt("layer_types", None, list)
    if types is None:
        interval = cfg.opt("full_attention_interval", 4, int)
        cfg.require(interval >= 1, "full_attention_interval", interval, "an integer >= 1")
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    cfg.require(len(types) == n, "layer_types", types, f"{n} entries (one per layer)")
    bad = [t for t in types if t not in LAYER_TYPES]
    cfg.require(not bad, "layer_types", types, f"entries among {', '.join(LAYER_TYPES)}")
    return types


def deltanet(cfg: Config) -> GatedDeltaNetSpec:
    """The gated DeltaNet of a config (`linear_*` keys)."""
    n_k, n_v = cfg.req("linear_num_key_heads"), cfg.req("linear_num_value_heads")
    for key, value in (("linear_num_key_heads", n_k), ("linear_num_value_heads", n_v)):
        cfg.require(value >= 1, key, value, "an integer >= 1")
    cfg.require(n_v % n_k == 0, "linear_num_value_heads", n_v, f"a multiple of linear_num_key_heads ({n_k})")
    dims = {key: cfg.req(key) for key in ("linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")}
    for key, value in dims.items():
        cfg.require(value >= 1, key, value, "an integer >= 1")
    return GatedDeltaNetSpec(
        n_k_heads=n_k, n_v_heads=n_v, k_head_dim=dims["linear_key_head_dim"],
        v_head_dim=dims["linear_value_head_dim"], conv_kernel=dims["linear_conv_kernel_dim"],
        act=cfg.opt("hidden_act", "silu", str), rms_eps=cfg.opt("rms_norm_eps", 1e-6, float),
    )


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a Qwen3-Next config.json."""
    cfg = _with_defaults(cfg)
    act = cfg.opt("hidden_act", "silu", str)
    n = cfg.req("num_hidden_layers")
    types = layer_types(cfg, n)
    bias = cfg.opt("attention_bias", False, bool)
    attn = gqa_attention(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head")
    attn = dataclasses.replace(attn, output_gate=True)
    linear = deltanet(cfg) if "linear_attention" in types else None
    n_experts = cfg.req("num_experts")
    shared = cfg.opt("shared_expert_intermediate_size", 512, int)
    moe = MoESpec(
        n_experts=n_experts,
        top_k=cfg.req("num_experts_per_tok"),
        expert_ffn=cfg.req("moe_intermediate_size"),
        norm_topk_prob=cfg.opt("norm_topk_prob", True, bool),
        shared_ffn=shared,
        shared_gate=shared > 0,      # with no shared expert its gate scales zeros: left unread (ignored_tensors)
        act=act,
    )
    step = cfg.opt("decoder_sparse_step", 1, int)
    mlp_only_list = cfg.opt("mlp_only_layers", [], list)
    cfg.require(all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only_list), "mlp_only_layers",
                mlp_only_list, "a list of layer indices")
    sparse = [i not in set(mlp_only_list) and n_experts > 0 and (i + 1) % step == 0 for i in range(n)]
    if any(sparse):
        moe_counts(cfg, n_experts, moe.top_k, "num_experts")
    dense = dense_mlp(cfg, act) if not all(sparse) else MLPSpec(intermediate=cfg.req("intermediate_size"), act=act)
    layers = tuple(LayerSpec(linear if t == "linear_attention" else attn, moe if sparse[i] else dense)
                   for i, t in enumerate(types))
    return ModelSpec(architecture=architecture, layers=layers, norm_offset=1.0, **model_fields(cfg))


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints carry that the model does not read: the multi-token-prediction head (`mtp.*`)
    and, with `shared_expert_intermediate_size` 0, the empty shared expert and its gate."""
    cfg = _with_defaults(cfg)
    patterns = ROPE_BUFFERS + (r"mtp\..+",)
    if cfg.opt("shared_expert_intermediate_size", 512, int) == 0:
        patterns += (r"model\.layers\.\d+\.mlp\.shared_expert(?:_gate)?\..+",)
    return patterns
