"""Phi-3 (Phi3ForCausalLM): Llama's pre-norm GQA layers with q, k and v fused in one `qkv_proj` and gate and
up in one `gate_up_proj`, an optional sliding window on every layer, and optionally partial rotary.

`fused_tensors` cuts the fused matrices by rows into Colibri's q/k/v and gate/up tensors. Dropouts
(`resid_pdrop`, `embd_pdrop`, `attention_dropout`) do nothing at inference and are not read.

RoPE: the default one, or LongRoPE (`longrope`, and the `su` / `yarn` spellings Phi3Config maps to it). The
reference rotates a whole sequence with the short factors while it is at most `original_max_position_embeddings`
long and with the long factors once it is longer (its generate() then recomputes the cache). Colibri runs the
short factors and makes that length the model's context (`max_position`; the rotary tables refuse positions past
it), so every cached key is rotated as the reference rotates it and the answer never depends on the cache.
Longer contexts would need the cached keys of a sequence re-rotated when it crosses that length.
"""

from __future__ import annotations

import dataclasses

from engine.errors import ModelFormatError
from engine.formats.fused import FusedTensor, Piece
from engine.models.config import (
    ROPE_BUFFERS,
    Config,
    dense_mlp,
    gqa_attention,
    longrope_from_config,
    model_fields,
    rope_params,
)
from engine.spec import LayerSpec, ModelSpec, RopeSpec

ARCHITECTURES = ("Phi3ForCausalLM",)
_LAYER = r"model\.layers\.(\d+)"

# Phi3Config's defaults where they differ from the shared readers' (a config.json may leave them out)
DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 32000, "hidden_act": "silu"}


def _with_defaults(cfg: Config) -> Config:
    data = dict(cfg.data)
    for key, value in DEFAULTS.items():
        if key not in data:
            data[key] = value
    return Config(data, cfg.source)


def _longrope(cfg: Config) -> RopeSpec | None:
    """LongRoPE at its short factors, limited to the length they serve; None for the default RoPE (Phi3Config
    reads `su` and `yarn` as LongRoPE and refuses every other type)."""
    params = rope_params(cfg)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("longrope", "su", "yarn"):
        raise ModelFormatError(f"{cfg.source}: rope type {kind!r} is not supported for Phi-3 (supported: default, "
                               "longrope and its older spellings 'su' and 'yarn')")
    plain = Config({k: v for k, v in cfg.data.items() if k not in ("rope_scaling", "rope_parameters")}, cfg.source)
    head_dim = gqa_attention(plain, qkv_bias=False, o_bias=False).head_dim
    rope, _ = longrope_from_config(cfg, head_dim, 10000.0)
    return dataclasses.replace(rope, max_position=rope.original_max_position)


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a Phi-3 config.json."""
    cfg = _with_defaults(cfg)
    longrope = _longrope(cfg)
    window = cfg.opt("sliding_window", None, int)
    cfg.require(window is None or window >= 1, "sliding_window", window, "a window of positions >= 1, or null")
    # the reference has no q/k/v, o or MLP biases
    fields = model_fields(cfg)
    if longrope is None:
        attn = gqa_attention(cfg, qkv_bias=False, o_bias=False, sliding_window=window)
    else:       # the context is the length the short factors serve
        plain = Config({k: v for k, v in cfg.data.items() if k not in ("rope_scaling", "rope_parameters")}, cfg.source)
        attn = dataclasses.replace(gqa_attention(plain, qkv_bias=False, o_bias=False, sliding_window=window),
                                   rope=longrope)
        fields["max_position"] = min(fields["max_position"], longrope.original_max_position)
    mlp = dense_mlp(cfg, cfg.opt("hidden_act", "silu", str))
    layers = tuple(LayerSpec(attn, mlp) for _ in range(cfg.req("num_hidden_layers")))
    return ModelSpec(architecture=architecture, layers=layers, **fields)


def fused_tensors(cfg: Config) -> tuple[FusedTensor, ...]:
    """Phi-3's `qkv_proj` (q, k, v rows) and `gate_up_proj` (gate rows, then up rows), in Colibri's names."""
    cfg = _with_defaults(cfg)
    attn = gqa_attention(Config({k: v for k, v in cfg.data.items() if k not in ("rope_scaling", "rope_parameters")},
                                cfg.source), qkv_bias=False, o_bias=False)
    q, kv = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    i = cfg.req("intermediate_size")
    a, m = r"model.layers.\1.self_attn", r"model.layers.\1.mlp"
    return (
        FusedTensor(_LAYER + r"\.self_attn\.qkv_proj\.weight", (
            Piece(f"{a}.q_proj.weight", start=0, stop=q),
            Piece(f"{a}.k_proj.weight", start=q, stop=q + kv),
            Piece(f"{a}.v_proj.weight", start=q + kv, stop=q + 2 * kv),
        )),
        FusedTensor(_LAYER + r"\.mlp\.gate_up_proj\.weight", (
            Piece(f"{m}.gate_proj.weight", start=0, stop=i),
            Piece(f"{m}.up_proj.weight", start=i, stop=2 * i),
        )),
    )


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read."""
    return ROPE_BUFFERS
