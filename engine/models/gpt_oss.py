"""gpt-oss: attention with per-head sinks, alternating sliding-window and full layers, biases on q/k/v/o,
YaRN, and a MoE whose router has a bias and whose experts carry biases and a clamped SwiGLU.

Checkpoints saved by transformers hold each layer's experts fused (`experts.gate_up_proj` [E, hidden, 2I],
gate and up interleaved column by column, stored [in, out]; `experts.down_proj` [E, I, hidden]; their
biases [E, 2I] and [E, hidden]); `fused_tensors` cuts them into per-expert tensors. The published
checkpoints store the experts in MXFP4 (`*_blocks` / `*_scales`): the folder shows each pair under the fused
tensor's name and these same rules cut it into per-expert MXFP4 tensors (engine/formats/published.py).
"""

from __future__ import annotations

import dataclasses

from engine.errors import ModelFormatError
from engine.formats.fused import FusedTensor, Piece
from engine.models.config import ROPE_BUFFERS, Config, gqa_attention, model_fields, moe_counts, sliding_windows
from engine.spec import LayerSpec, ModelSpec, MoESpec

ARCHITECTURES = ("GptOssForCausalLM",)
# the reference's defaults when config.json leaves them out (GptOssConfig)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
DEFAULT_THETA = 150000.0
_EXPERTS = r"model\.layers\.(\d+)\.mlp\.experts"


def _with_defaults(cfg: Config) -> Config:
    """The config with the reference's defaults filled in where it is silent (RoPE, layer types, window)."""
    data = dict(cfg.data)
    if data.get("rope_parameters") is None and data.get("rope_scaling") is None:
        data["rope_parameters"] = dict(DEFAULT_ROPE)
    params = data.get("rope_parameters") or data.get("rope_scaling")
    if isinstance(params, dict) and params.get("rope_theta") is None and data.get("rope_theta") is None:
        data["rope_theta"] = DEFAULT_THETA
    n = cfg.req("num_hidden_layers")
    if data.get("layer_types") is None:   # even layers slide, odd layers see everything
        data["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if "sliding_window" not in data:
        data["sliding_window"] = 128
    return Config(data, cfg.source)


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a gpt-oss config.json."""
    quant = cfg.opt("quantization_config", None, dict)
    if quant is not None and quant.get("quant_method") != "mxfp4":   # MXFP4 experts: engine/formats/published.py
        raise ModelFormatError(
            f"{cfg.source}: this gpt-oss checkpoint is quantized with quantization_config.quant_method "
            f"{quant.get('quant_method', 'unknown')!r}, which Colibri does not read; use the MXFP4 release or a "
            "bfloat16 copy of the model"
        )
    cfg = _with_defaults(cfg)
    n = cfg.req("num_hidden_layers")
    types = cfg.opt("layer_types", None, list)
    cfg.require(all(t in ("sliding_attention", "full_attention") for t in types), "layer_types", types,
                "a list of 'sliding_attention' / 'full_attention'")
    windows = sliding_windows(cfg, n)
    n_experts, top_k = cfg.first(("num_local_experts", "num_experts")), cfg.req("num_experts_per_tok")
    moe_counts(cfg, n_experts, top_k, "num_local_experts")
    limit, alpha = cfg.opt("swiglu_limit", 7.0, float), cfg.opt("swiglu_alpha", 1.702, float)
    cfg.require(limit > 0, "swiglu_limit", limit, "a positive clamp")
    moe = MoESpec(
        n_experts=n_experts,
        top_k=top_k,
        expert_ffn=cfg.req("intermediate_size"),
        norm_topk_prob=True,        # a softmax over the chosen experts' logits: softmax over all, renormalised
        router_bias=True,
        expert_bias=True,
        swiglu_limit=limit,
        swiglu_alpha=alpha,
    )
    bias = cfg.opt("attention_bias", True, bool)
    layers = []
    for i in range(n):
        attn = gqa_attention(cfg, qkv_bias=bias, o_bias=bias, sliding_window=windows[i])
        layers.append(LayerSpec(dataclasses.replace(attn, sinks=True), moe))
    return ModelSpec(architecture=architecture, layers=tuple(layers), **model_fields(cfg))


def fused_tensors(cfg: Config) -> tuple[FusedTensor, ...]:
    """The fused experts and router of transformers' gpt-oss checkpoints, cut into Colibri's names."""
    i = cfg.req("intermediate_size")
    e = r"model.layers.\1.mlp.experts.{e}"
    return (
        FusedTensor(_EXPERTS + r"\.gate_up_proj", (
            Piece(f"{e}.gate_proj.weight", axis=1, start=0, stop=2 * i, step=2, transpose=True),
            Piece(f"{e}.up_proj.weight", axis=1, start=1, stop=2 * i, step=2, transpose=True),
        ), per_expert=True),
        FusedTensor(_EXPERTS + r"\.gate_up_proj_bias", (
            Piece(f"{e}.gate_proj.bias", start=0, stop=2 * i, step=2),
            Piece(f"{e}.up_proj.bias", start=1, stop=2 * i, step=2),
        ), per_expert=True),
        FusedTensor(_EXPERTS + r"\.down_proj", (Piece(f"{e}.down_proj.weight", transpose=True),), per_expert=True),
        FusedTensor(_EXPERTS + r"\.down_proj_bias", (Piece(f"{e}.down_proj.bias"),), per_expert=True),
        FusedTensor(r"model\.layers\.(\d+)\.mlp\.router\.weight", (Piece(r"model.layers.\1.mlp.gate.weight"),)),
        FusedTensor(r"model\.layers\.(\d+)\.mlp\.router\.bias", (Piece(r"model.layers.\1.mlp.gate.bias"),)),
    )


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read."""
    return ROPE_BUFFERS
