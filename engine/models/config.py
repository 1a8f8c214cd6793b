"""Reading config.json values into spec pieces, shared by the family modules.

Both spellings real checkpoints carry are read: transformers 5's `rope_parameters` and the older
top-level `rope_theta` + `rope_scaling`. Missing or malformed values raise a ModelFormatError that
names the key.
"""

from __future__ import annotations

from typing import Any, Mapping

from engine.errors import ModelFormatError
from engine.spec import AttentionSpec, LayerSpec, MLPSpec, RopeSpec

ROPE_KINDS = ("default", "linear", "llama3", "yarn")


class Config:
    """A config.json dict with getters that explain what is wrong."""

    def __init__(self, data: Mapping[str, Any], source: str = "config.json"):
        self.data = dict(data)
        self.source = source

    def req(self, key: str, kind: type = int) -> Any:
        """A required value of the given type."""
        if self.data.get(key) is None:
            raise ModelFormatError(f"{self.source}: required key {key!r} is missing; the config is incomplete")
        return self._typed(key, self.data[key], kind)

    def opt(self, key: str, default: Any, kind: type | None = None) -> Any:
        """An optional value (None counts as missing)."""
        value = self.data.get(key)
        if value is None:
            return default
        return self._typed(key, value, kind or type(default)) if (kind or default is not None) else value

    def first(self, keys: tuple[str, ...], kind: type = int, default: Any = ...) -> Any:
        """The first of several spellings that is present."""
        for key in keys:
            if self.data.get(key) is not None:
                return self._typed(key, self.data[key], kind)
        if default is ...:
            raise ModelFormatError(f"{self.source}: none of {', '.join(map(repr, keys))} is set; the config is incomplete")
        return default

    def _typed(self, key: str, value: Any, kind: type) -> Any:
        try:
            if kind is bool:
                if not isinstance(value, bool):
                    raise TypeError
                return value
            if kind is int and (isinstance(value, bool) or (isinstance(value, float) and not value.is_integer())):
                raise TypeError
            return kind(value)
        except (TypeError, ValueError):
            raise ModelFormatError(f"{self.source}: {key!r} is {value!r}, expected {kind.__name__}") from None


def rope_from_config(cfg: Config, dim: int, *, interleaved: bool = False) -> RopeSpec:
    """The RoPE of a config, from `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    params = dict(cfg.data.get("rope_scaling") or {})
    params.update(cfg.data.get("rope_parameters") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_KINDS:
        raise ModelFormatError(
            f"{cfg.source}: rope type {kind!r} is not supported (supported: {', '.join(ROPE_KINDS)})"
        )
    theta = float(params.get("rope_theta", cfg.data.get("rope_theta") or 10000.0))
    partial = float(params.get("partial_rotary_factor", cfg.data.get("partial_rotary_factor") or 1.0))
    rot_dim = int(dim * partial)
    max_pos = cfg.opt("max_position_embeddings", 2048, int)
    original = int(params.get("original_max_position_embeddings") or max_pos)
    factor = params.get("factor")
    if kind == "yarn" and factor is None:
        factor = max_pos / original
    if kind in ("linear", "llama3") and factor is None:
        raise ModelFormatError(f"{cfg.source}: rope type {kind!r} needs a 'factor'")
    return RopeSpec(
        dim=rot_dim,
        theta=theta,
        kind=kind,
        factor=float(factor if factor is not None else 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
        interleaved=interleaved,
        freq_factors=tuple(float(f) for f in params["freq_factors"]) if params.get("freq_factors") else None,
    )


def sliding_windows(cfg: Config, n_layers: int) -> list[int | None]:
    """Per layer, the sliding window or None, from `layer_types` or `use_sliding_window`."""
    window = cfg.data.get("sliding_window")
    types = cfg.data.get("layer_types")
    if types is None:
        if not cfg.data.get("use_sliding_window", False) or not window:
            return [None] * n_layers
        first = cfg.opt("max_window_layers", n_layers, int)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    if len(types) != n_layers:
        raise ModelFormatError(f"{cfg.source}: 'layer_types' has {len(types)} entries for {n_layers} layers")
    return [int(window) if t == "sliding_attention" and window else None for t in types]


def gqa_attention(
    cfg: Config,
    *,
    qkv_bias: bool,
    o_bias: bool,
    qk_norm: str | None = None,
    sliding_window: int | None = None,
) -> AttentionSpec:
    """The usual grouped-query attention of a config (heads, head_dim, RoPE)."""
    hidden = cfg.req("hidden_size")
    n_heads = cfg.req("num_attention_heads")
    n_kv = cfg.opt("num_key_value_heads", n_heads, int)
    head_dim = cfg.opt("head_dim", hidden // n_heads, int)
    if n_heads % n_kv:
        raise ModelFormatError(f"{cfg.source}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    return AttentionSpec(
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        rope=rope_from_config(cfg, head_dim),
        scale=head_dim**-0.5,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=qk_norm,
        clip_qkv=cfg.opt("clip_qkv", None, float),
        sliding_window=sliding_window,
    )


def dense_layers(cfg: Config, **attn: Any) -> tuple[LayerSpec, ...]:
    """Layers with GQA attention and a dense gated MLP of `intermediate_size`."""
    n = cfg.req("num_hidden_layers")
    windows = sliding_windows(cfg, n)
    mlp = MLPSpec(intermediate=cfg.req("intermediate_size"), act=cfg.opt("hidden_act", "silu", str))
    return tuple(LayerSpec(gqa_attention(cfg, sliding_window=windows[i], **attn), mlp) for i in range(n))


def eos_ids(value: Any) -> tuple[int, ...]:
    """eos_token_id as a tuple (configs give an int, a list, or nothing)."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def model_fields(cfg: Config) -> dict[str, Any]:
    """The ModelSpec fields every family reads the same way."""
    return dict(
        vocab_size=cfg.req("vocab_size"),
        hidden_size=cfg.req("hidden_size"),
        rms_eps=cfg.opt("rms_norm_eps", 1e-6, float),
        tie_embeddings=cfg.opt("tie_word_embeddings", False, bool),
        max_position=cfg.opt("max_position_embeddings", 2048, int),
        bos_token_id=cfg.opt("bos_token_id", None, int),
        eos_token_ids=eos_ids(cfg.data.get("eos_token_id")),
    )
