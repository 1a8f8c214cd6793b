"""Qwen3.5-MoE's text model: Qwen3-Next's hybrid of gated DeltaNet and gated full attention, with three changes.

DeltaNet's input projections are stored apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, heads
in order) rather than fused per key head; every layer is sparse (no `decoder_sparse_step`, `mlp_only_layers`
or dense `intermediate_size`), the router always renormalises its top-k, and a sigmoid-gated shared expert
is always there; RoPE is multimodal (`mrope_section`), which on text positions (the same position on every
axis) is the plain partial rotary of Qwen3-Next.

Published checkpoints are `Qwen3_5MoeForConditionalGeneration`: the text model's keys sit in `text_config`,
its tensors under `model.language_model.`, beside a vision tower (`model.visual.*`) that the engine does not
run and leaves unread. `Qwen3_5MoeForCausalLM` is the text model alone (`model.layers.*`).
"""

from __future__ import annotations

import dataclasses
import logging

from engine.blocks.norm import ACTIVATIONS
from engine.formats.fused import FusedTensor, Piece
from engine.models import qwen3_next
from engine.models.config import ROPE_BUFFERS, Config, gqa_attention, model_fields, moe_counts
from engine.spec import LayerSpec, ModelSpec, MoESpec

ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
VISION = "Qwen3_5MoeForConditionalGeneration"

log = logging.getLogger(__name__)

# the reference configuration's defaults (Qwen3_5MoeTextConfig) where they differ from Qwen3-Next's
DEFAULTS = {**qwen3_next.DEFAULTS, "num_experts_per_tok": 8, "num_experts": 256}
# keys of Qwen3-Next that the Qwen3.5 text config no longer has: a value there would not be honoured
REMOVED = ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")


def text_config(cfg: Config, architecture: str) -> Config:
    """The text model's keys: `text_config` of a vision-language config (where it is a dict), else the config."""
    if architecture != VISION or "text_config" not in cfg.data:
        return cfg
    text = cfg.data.get("text_config")
    cfg.require(isinstance(text, dict), "text_config", text, "an object with the text model's configuration")
    # the reference ties the head by the outer config's tie_word_embeddings (False when absent), never the text's
    data = {**text, "tie_word_embeddings": cfg.data.get("tie_word_embeddings", False)}
    return Config(data, f"{cfg.source} (text_config)")


def _with_defaults(cfg: Config) -> Config:
    data = {**DEFAULTS, **{k: v for k, v in cfg.data.items() if v is not None}}
    rope = data.get("rope_parameters") if isinstance(data.get("rope_parameters"), dict) else {}
    if "partial_rotary_factor" not in data and "partial_rotary_factor" not in rope:
        data["partial_rotary_factor"] = 0.25
    return Config(data, cfg.source)


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a Qwen3.5-MoE config.json (its text model)."""
    if architecture == VISION:
        log.info("%s: running the text model; the vision tower's tensors (model.visual.*) are left unread",
                 cfg.source)
    cfg = _with_defaults(text_config(cfg, architecture))
    for key in REMOVED:
        # the reference ignores these keys: a value that would change the maths under Qwen3-Next's reading is refused
        value = cfg.data.get(key)
        honoured = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}[key]
        cfg.require(value is None or value == honoured, key, value,
                    f"{honoured!r} or absent (Qwen3.5-MoE has no such setting)")
    act = cfg.opt("hidden_act", "silu", str)
    # the convolution's and the experts' activation: refused at open, not at the first token
    cfg.require(act in ACTIVATIONS, "hidden_act", act, f"one of {', '.join(sorted(ACTIVATIONS))}")
    n = cfg.req("num_hidden_layers")
    types = qwen3_next.layer_types(cfg, n)
    bias = cfg.opt("attention_bias", False, bool)
    attn = dataclasses.replace(gqa_attention(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head"), output_gate=True)
    linear = None
    if "linear_attention" in types:
        linear = dataclasses.replace(qwen3_next.deltanet(cfg), split_proj=True)
    shared = cfg.opt("shared_expert_intermediate_size", 512, int)
    cfg.require(shared >= 1, "shared_expert_intermediate_size", shared, "a positive size (the shared expert is always there)")
    moe = MoESpec(
        n_experts=cfg.req("num_experts"), top_k=cfg.req("num_experts_per_tok"),
        expert_ffn=cfg.req("moe_intermediate_size"), norm_topk_prob=True,
        shared_ffn=shared, shared_gate=True, act=act,
    )
    moe_counts(cfg, moe.n_experts, moe.top_k, "num_experts")
    layers = tuple(LayerSpec(linear if t == "linear_attention" else attn, moe) for t in types)
    return ModelSpec(architecture=architecture, layers=layers, norm_offset=1.0, **model_fields(cfg))


def fused_tensors(cfg: Config) -> tuple[FusedTensor, ...]:
    """The vision-language checkpoint's text tensors (`model.language_model.*`) under the engine's names, and
    experts fused per layer (`experts.gate_up_proj` [E, 2I, hidden], `experts.down_proj` [E, hidden, I]) cut
    into per-expert tensors, under either prefix."""
    text = _with_defaults(text_config(cfg, VISION))
    i = text.opt("moe_intermediate_size", 512, int)
    layers = r"model\.(?:language_model\.)?layers\.(\d+)\.mlp\.experts"
    e = r"model.layers.\1.mlp.experts.{e}"
    gate_up = (Piece(f"{e}.gate_proj.weight", start=0, stop=i), Piece(f"{e}.up_proj.weight", start=i, stop=2 * i))
    return (
        FusedTensor(layers + r"\.gate_up_proj", gate_up, per_expert=True),
        FusedTensor(layers + r"\.down_proj", (Piece(f"{e}.down_proj.weight"),), per_expert=True),
        FusedTensor(r"model\.language_model\.((?!layers\.\d+\.mlp\.experts\.(?:gate_up|down)_proj$).+)",
                    (Piece(r"model.\1"),)),
    )


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints carry that the model does not read: the vision tower (`model.visual.*`) and the
    multi-token-prediction head (`mtp.*`)."""
    return ROPE_BUFFERS + (r"mtp\..+", r"model\.visual\..+")
