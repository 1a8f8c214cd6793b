"""Phi-3 (Phi3ForCausalLM): Llama's pre-norm GQA layers with q, k and v fused in one `qkv_proj` and gate and
up in one `gate_up_proj`, an optional sliding window on every layer, and optionally partial rotary.

`fused_tensors` cuts the fused matrices by rows into Colibri's q/k/v and gate/up tensors. Dropouts
(`resid_pdrop`, `embd_pdrop`, `attention_dropout`) do nothing at inference and are not read.

RoPE: the default one only. LongRoPE (`longrope`, and the `su` / `yarn` spellings Phi3Config maps to it)
is refused: the reference switches every position from the short to the long factors once a sequence
passes `original_max_position_embeddings`, which a cache of rotated keys does not follow yet.
"""

from __future__ import annotations

from engine.errors import ModelFormatError
from engine.formats.fused import FusedTensor, Piece
from engine.models.config import ROPE_BUFFERS, Config, dense_mlp, gqa_attention, model_fields
from engine.spec import LayerSpec, ModelSpec

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


def _check_rope(cfg: Config) -> None:
    """Refuse every RoPE but the default one (Phi3Config reads `su` and `yarn` as LongRoPE)."""
    for key in ("rope_scaling", "rope_parameters"):
        cfg.require(isinstance(cfg.data.get(key) or {}, dict), key, cfg.data.get(key), "an object")
    params = dict(cfg.data.get("rope_scaling") or {})
    params.update(cfg.data.get("rope_parameters") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise ModelFormatError(
            f"{cfg.source}: rope type {kind!r} is not supported for Phi-3 (supported: default). Phi-3 reads "
            "'longrope', 'su' and 'yarn' as LongRoPE, whose switch from short to long factors past "
            "original_max_position_embeddings Colibri does not implement yet; use a Phi-3 checkpoint with the "
            "default RoPE (e.g. Phi-3-mini-4k)")


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a Phi-3 config.json."""
    cfg = _with_defaults(cfg)
    _check_rope(cfg)
    window = cfg.opt("sliding_window", None, int)
    cfg.require(window is None or window >= 1, "sliding_window", window, "a window of positions >= 1, or null")
    # the reference has no q/k/v, o or MLP biases
    attn = gqa_attention(cfg, qkv_bias=False, o_bias=False, sliding_window=window)
    mlp = dense_mlp(cfg, cfg.opt("hidden_act", "silu", str))
    layers = tuple(LayerSpec(attn, mlp) for _ in range(cfg.req("num_hidden_layers")))
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg))


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
