"""Gemma 2 and Gemma 3 (text): local (sliding-window) and global layers, `(1 + w)` RMSNorms, four norms per
layer, embeddings scaled by sqrt(hidden), GELU-tanh, `query_pre_attn_scalar`, optional logit soft-capping
(of the final logits for both; of attention scores for Gemma 2 only, as the reference applies it).

Gemma 3 adds per-head q/k norms and its own RoPE for the local layers (`rope_local_base_freq`, or the
"sliding_attention" entry of `rope_parameters`); RoPE scaling applies to the global layers only.

`Gemma3ForConditionalGeneration` (the published Gemma 3 checkpoints from 4B up) is the same text model with its
keys in `text_config` and its tensors under `model.language_model.` (transformers 5) or `language_model.model.`
(the Hub's files), beside a vision tower and projector the engine leaves unread. Its reference does not soft-cap
the final logits, whatever the text config says.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from engine.blocks.norm import activation
from engine.formats.fused import FusedTensor, Piece
from engine.models.config import (
    ROPE_BUFFERS,
    Config,
    dense_mlp,
    gqa_attention,
    model_fields,
    rope_from_config,
)
from engine.spec import LayerSpec, ModelSpec, RopeSpec

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
VISION = "Gemma3ForConditionalGeneration"
LAYER_TYPES = ("sliding_attention", "full_attention")

log = logging.getLogger(__name__)

# The reference's defaults where config.json leaves a key out (a key given as null means "off" instead)
DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": dict(bos_token_id=2, eos_token_id=1, num_key_value_heads=4,
                              head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, rms_norm_eps=1e-6,
                              tie_word_embeddings=True, max_position_embeddings=8192, final_logit_softcapping=30.0,
                              attn_logit_softcapping=50.0, hidden_activation="gelu_pytorch_tanh"),
    "Gemma3ForCausalLM": dict(bos_token_id=2, eos_token_id=1, num_key_value_heads=4,
                              head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, rms_norm_eps=1e-6,
                              tie_word_embeddings=True, max_position_embeddings=131_072,
                              final_logit_softcapping=None, attn_logit_softcapping=None,
                              hidden_activation="gelu_pytorch_tanh"),
}
# the Hub's vision-language configs leave most text keys to Gemma3TextConfig's defaults
DEFAULTS[VISION] = dict(DEFAULTS["Gemma3ForCausalLM"], vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
                        num_hidden_layers=26, num_attention_heads=8)
GLOBAL_THETA = {"Gemma2ForCausalLM": 10_000.0, "Gemma3ForCausalLM": 1_000_000.0, VISION: 1_000_000.0}
# the outer config's keys that the reference takes over the text config's
OUTER = ("tie_word_embeddings", "bos_token_id", "eos_token_id")
LOCAL_THETA = 10_000.0


def _given(cfg: Config, key: str, defaults: dict[str, Any]) -> Any:
    """The key's value: the reference's default when left out, None when given as null."""
    return cfg.data[key] if key in cfg.data else defaults.get(key)


def _cap(cfg: Config, key: str, defaults: dict[str, Any]) -> float | None:
    value = _given(cfg, key, defaults)
    if value is None:
        return None
    cap = Config({key: value}, cfg.source).req(key, float)
    cfg.require(cap > 0, key, value, "a positive soft-capping value (or null for none)")
    return cap


def _layer_types(cfg: Config, architecture: str, n: int) -> list[str]:
    """Each layer's type: `layer_types`, else every `sliding_window_pattern`-th layer global (Gemma 3, default
    6), every second one for Gemma 2."""
    types = cfg.opt("layer_types", None, list)
    if types is None:
        pattern = cfg.opt("sliding_window_pattern", 6, int) if architecture != "Gemma2ForCausalLM" else 2
        cfg.require(pattern >= 1, "sliding_window_pattern", pattern, "an integer >= 1")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    cfg.require(len(types) == n and all(t in LAYER_TYPES for t in types), "layer_types", types,
                f"{n} entries, each one of {', '.join(LAYER_TYPES)}")
    return types


def _ropes(cfg: Config, architecture: str, head_dim: int) -> dict[str, RopeSpec]:
    """The RoPE of each layer type. transformers 5 nests `rope_parameters` by layer type; older configs give
    `rope_theta` + `rope_scaling` for the global layers and `rope_local_base_freq` for the local ones."""
    params = cfg.data.get("rope_parameters")
    nested = isinstance(params, dict) and any(k in params for k in LAYER_TYPES)
    if architecture == "Gemma2ForCausalLM" and not nested:     # one RoPE for both kinds of layer
        rope = rope_from_config(cfg, head_dim)
        return {t: rope for t in LAYER_TYPES}
    out = {}
    for t in LAYER_TYPES:
        if nested:
            sub = params.get(t)
            cfg.require(isinstance(sub, dict), f"rope_parameters.{t}", sub, "an object of RoPE parameters")
            theta = cfg.opt("rope_theta", GLOBAL_THETA[architecture], float) if t == "full_attention" \
                else cfg.opt("rope_local_base_freq", LOCAL_THETA, float)
            data = {"rope_parameters": sub, "rope_theta": theta}
        elif t == "full_attention":
            data = {"rope_parameters": params, "rope_scaling": cfg.data.get("rope_scaling"),
                    "rope_theta": cfg.opt("rope_theta", GLOBAL_THETA[architecture], float)}
        else:                                  # the local layers: their own base, never scaled
            data = {"rope_theta": cfg.opt("rope_local_base_freq", LOCAL_THETA, float)}
        data["max_position_embeddings"] = cfg.data.get("max_position_embeddings")
        out[t] = rope_from_config(Config(data, cfg.source), head_dim)
    return out


def text_config(cfg: Config, architecture: str) -> Config:
    """The text model's keys: `text_config` of the vision-language config (with the outer config's tying and
    token ids, which the reference reads there), else the config itself."""
    if architecture != VISION:
        return cfg
    text = cfg.data.get("text_config") or {}
    cfg.require(isinstance(text, dict), "text_config", text, "an object with the text model's configuration")
    outer = {k: cfg.data[k] for k in OUTER if cfg.data.get(k) is not None}
    return Config({**text, **outer}, f"{cfg.source} (text_config)")


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a Gemma 2 or Gemma 3 (text) config.json, or of Gemma 3's text model in a vision one."""
    if architecture == VISION:
        log.info("%s: running the text model; the vision tower and projector are left unread", cfg.source)
        cfg = text_config(cfg, architecture)
    defaults = DEFAULTS[architecture]
    cfg = Config({**{k: v for k, v in defaults.items() if v is not None}, **cfg.data}, cfg.source)
    if cfg.opt("use_bidirectional_attention", False, bool):
        raise cfg.invalid("use_bidirectional_attention", True, "false: only causal attention is supported (the "
                          "bidirectional variant is an encoder)")
    n = cfg.req("num_hidden_layers")
    types = _layer_types(cfg, architecture, n)
    window = _given(cfg, "sliding_window", defaults)
    if "sliding_attention" in types:
        cfg.require(isinstance(window, int) and not isinstance(window, bool) and window >= 1, "sliding_window",
                    window, "a window of positions >= 1 for the sliding_attention layers")
    scalar = cfg.req("query_pre_attn_scalar", float)
    cfg.require(scalar > 0, "query_pre_attn_scalar", scalar, "a positive number")
    # Gemma 3's reference reads attn_logit_softcapping but never applies it (its attention gets no softcap):
    # its scores stay uncapped here too. The final logits' cap applies to both.
    softcap = _cap(cfg, "attn_logit_softcapping", defaults) if architecture == "Gemma2ForCausalLM" else None
    bias = cfg.opt("attention_bias", False, bool)
    qk_norm = "head" if architecture != "Gemma2ForCausalLM" else None
    base = gqa_attention(cfg, qkv_bias=bias, o_bias=bias, qk_norm=qk_norm)
    base = dataclasses.replace(base, scale=scalar**-0.5, softcap=softcap, clip_qkv=None)
    ropes = _ropes(cfg, architecture, base.head_dim)
    mlp = dense_mlp(cfg, cfg.opt("hidden_activation", "gelu_pytorch_tanh", str))
    activation(mlp.act)                                   # refused here, at open, when not one the engine runs
    layers = tuple(
        LayerSpec(dataclasses.replace(base, rope=ropes[t], sliding_window=window if t == "sliding_attention" else None),
                  mlp, norms="sandwich")
        for t in types
    )
    hidden = cfg.req("hidden_size")
    final_cap = _cap(cfg, "final_logit_softcapping", defaults) if architecture != VISION else None
    return ModelSpec(architecture=architecture, layers=layers, embed_scale=math.sqrt(hidden), norm_offset=1.0,
                     final_softcap=final_cap, **model_fields(cfg))


def fused_tensors(cfg: Config) -> tuple[FusedTensor, ...]:
    """The vision-language checkpoint's text tensors under the engine's names (none to rename otherwise)."""
    archs = cfg.data.get("architectures") or []
    if not archs or archs[0] != VISION:
        return ()
    return (
        FusedTensor(r"model\.language_model\.(.+)", (Piece(r"model.\1"),)),
        FusedTensor(r"language_model\.model\.(.+)", (Piece(r"model.\1"),)),
        FusedTensor(r"language_model\.lm_head\.weight", (Piece("lm_head.weight"),)),
    )


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read: in a vision-language checkpoint, the
    vision tower and its projector."""
    return ROPE_BUFFERS + (r"(?:model\.)?vision_tower\..+", r"(?:model\.)?multi_modal_projector\..+")
