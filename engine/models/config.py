"""Reading config.json values into spec pieces, shared by the family modules.

Both spellings real checkpoints carry are read: transformers 5's `rope_parameters` and the older
top-level `rope_theta` + `rope_scaling`. Missing, mistyped or out-of-range values raise a
ModelFormatError that names the key, the value and the fix: a config that would divide by zero, or
build a model of no layers that still emits text, never runs.
"""

from __future__ import annotations

from typing import Any, Mapping

from engine.errors import ModelFormatError
from engine.spec import AttentionSpec, LayerSpec, MLPSpec, RopeSpec

ROPE_KINDS = ("default", "linear", "llama3", "yarn")
FIX = "the config is damaged: fetch the model again (or correct the value)"
# Tensors any family's checkpoint may carry unread: RoPE's inverse frequencies, saved as a buffer by older
# transformers (Llama 2 era); the engine computes them from the config.
ROPE_BUFFERS = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)

# The least value of each count or size, checked wherever the key is read. 0 heads divides by zero, 0 or
# negative layers build a model that still emits text; intermediate_size and num_experts may be 0 in MoE
# configs (every layer sparse; Qwen2-MoE with no experts is dense), where the family checks what it uses.
AT_LEAST = {
    "hidden_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 1,
    "vocab_size": 1, "max_position_embeddings": 1, "intermediate_size": 0, "moe_intermediate_size": 1,
    "num_experts": 0, "num_local_experts": 0, "n_routed_experts": 1, "num_experts_per_tok": 1,
    "n_group": 1, "topk_group": 1, "n_shared_experts": 0, "shared_expert_intermediate_size": 0,
    "decoder_sparse_step": 1, "max_window_layers": 0, "first_k_dense_replace": 0,
    "kv_lora_rank": 1, "q_lora_rank": 1, "qk_rope_head_dim": 2, "qk_nope_head_dim": 0, "v_head_dim": 1,
    "bos_token_id": 0, "num_nextn_predict_layers": 0, "original_max_position_embeddings": 1,
}


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

    def invalid(self, key: str, value: Any, expected: str) -> ModelFormatError:
        """The error for a value of the wrong type or range: the key, the value, what is expected, the fix."""
        return ModelFormatError(f"{self.source}: {key!r} is {value!r:.80}, expected {expected}; {FIX}")

    def require(self, ok: bool, key: str, value: Any, expected: str) -> None:
        """Raise `invalid` unless `ok` (a check across keys: heads dividing hidden, top-k within experts ...)."""
        if not ok:
            raise self.invalid(key, value, expected)

    def _typed(self, key: str, value: Any, kind: type) -> Any:
        # JSON types only: a string "2" is not a count, 2.5 not a size, 1 not a flag
        numeric = kind in (int, float)
        if (kind is bool) != isinstance(value, bool) or (numeric and not isinstance(value, (int, float))) \
                or (kind in (str, list, dict) and not isinstance(value, kind)) \
                or (kind is int and isinstance(value, float) and not value.is_integer()):
            raise self.invalid(key, value, kind.__name__)
        try:
            out = kind(value)
        except (TypeError, ValueError, OverflowError):
            raise self.invalid(key, value, kind.__name__) from None
        low = AT_LEAST.get(key)
        if numeric and low is not None and not out >= low:   # `not >=` refuses NaN too
            raise self.invalid(key, value, f"an integer >= {low}")
        return out


def with_defaults(cfg: Config, defaults: Mapping[str, Any], aliases: Mapping[str, str] | None = None) -> Config:
    """The config with a family reference's defaults for the keys it leaves out (an alias, e.g. transformers'
    `attribute_map`, counts as the key). A key present with null keeps its null: for some keys (q_lora_rank)
    that is a choice, not an omission."""
    data = dict(cfg.data)
    for alias, key in (aliases or {}).items():
        if key not in data and alias in data:
            data[key] = data[alias]
    return Config({**{k: v for k, v in defaults.items() if k not in data}, **data}, cfg.source)


def rope_from_config(cfg: Config, dim: int, *, interleaved: bool = False) -> RopeSpec:
    """The RoPE of a config, from `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    for key in ("rope_scaling", "rope_parameters"):
        cfg.require(isinstance(cfg.data.get(key) or {}, dict), key, cfg.data.get(key), "an object")
    params = dict(cfg.data.get("rope_scaling") or {})
    params.update(cfg.data.get("rope_parameters") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    if not isinstance(kind, str) or kind not in ROPE_KINDS:
        raise ModelFormatError(
            f"{cfg.source}: rope type {kind!r} is not supported (supported: {', '.join(ROPE_KINDS)})"
        )
    rope = Config(params, cfg.source)                     # the RoPE keys, typed like any other
    theta = rope.opt("rope_theta", cfg.opt("rope_theta", 0.0, float) or 10000.0, float)
    rope.require(theta > 0, "rope_theta", theta, "a positive number")
    partial = rope.opt("partial_rotary_factor", cfg.opt("partial_rotary_factor", 0.0, float) or 1.0, float)
    rot_dim = int(dim * partial)
    rope.require(0 < rot_dim <= dim and rot_dim % 2 == 0, "partial_rotary_factor", partial,
                 f"a factor giving an even number of rotated features within the head's {dim}")
    max_pos = cfg.opt("max_position_embeddings", 2048, int)
    original = rope.opt("original_max_position_embeddings", max_pos, int)
    rope.require(original > 0, "original_max_position_embeddings", original, "a positive integer")
    factor = rope.opt("factor", None, float)
    if kind == "yarn" and factor is None:
        factor = max_pos / original
    if kind in ("linear", "llama3") and factor is None:
        raise ModelFormatError(f"{cfg.source}: rope type {kind!r} needs a 'factor'")
    if factor is not None:
        rope.require(factor > 0, "factor", factor, "a positive rope scaling factor")
    factors = params.get("freq_factors")
    rope.require(factors is None or (isinstance(factors, list) and len(factors) == rot_dim // 2
                                     and all(isinstance(f, (int, float)) and f > 0 for f in factors)),
                 "freq_factors", factors, f"{rot_dim // 2} positive numbers")
    return RopeSpec(
        dim=rot_dim,
        theta=theta,
        kind=kind,
        factor=float(factor if factor is not None else 1.0),
        low_freq_factor=rope.opt("low_freq_factor", 1.0, float),
        high_freq_factor=rope.opt("high_freq_factor", 4.0, float),
        original_max_position=original,
        beta_fast=float(rope.opt("beta_fast", 0.0, float) or 32.0),
        beta_slow=float(rope.opt("beta_slow", 0.0, float) or 1.0),
        mscale=rope.opt("mscale", 0.0, float),
        mscale_all_dim=rope.opt("mscale_all_dim", 0.0, float),
        attention_factor=rope.opt("attention_factor", None, float),
        truncate=rope.opt("truncate", True, bool),
        interleaved=interleaved,
        freq_factors=tuple(float(f) for f in factors) if factors else None,
    )


def rope_params(cfg: Config) -> dict[str, Any]:
    """The RoPE settings of a config: `rope_scaling` updated by `rope_parameters` (both must be objects)."""
    for key in ("rope_scaling", "rope_parameters"):
        cfg.require(isinstance(cfg.data.get(key) or {}, dict), key, cfg.data.get(key), "an object")
    params = dict(cfg.data.get("rope_scaling") or {})
    params.update(cfg.data.get("rope_parameters") or {})
    return params


def longrope_from_config(cfg: Config, head_dim: int, default_theta: float) -> tuple[RopeSpec, tuple[float, ...]]:
    """LongRoPE (Phi-3, PhiMoE) at its short factors, and its long factors. `factor` defaults to
    max_position_embeddings / original_max_position_embeddings and sets the cos/sin scale unless
    `attention_factor` is given, as the reference computes them."""
    params = rope_params(cfg)
    rope = Config(params, cfg.source)
    theta = rope.opt("rope_theta", cfg.opt("rope_theta", default_theta, float), float)
    rope.require(theta > 0, "rope_theta", theta, "a positive number")
    partial = rope.opt("partial_rotary_factor", cfg.opt("partial_rotary_factor", 1.0, float), float)
    dim = int(head_dim * partial)
    rope.require(0 < dim <= head_dim and dim % 2 == 0, "partial_rotary_factor", partial,
                 f"a factor giving an even number of rotated features within the head's {head_dim}")
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = params.get(key)
        rope.require(isinstance(value, list) and len(value) == dim // 2
                     and all(isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in value),
                     key, value, f"{dim // 2} positive numbers (one per rotated pair)")
        factors[key] = tuple(float(f) for f in value or ())
    # hub configs (Phi-3-mini-128k) keep it beside rope_scaling, transformers 5 writes it inside rope_parameters
    original = rope.opt("original_max_position_embeddings", cfg.opt("original_max_position_embeddings", None, int), int)
    if original is None:
        raise ModelFormatError(f"{cfg.source}: LongRoPE needs 'original_max_position_embeddings'; the config is "
                               "incomplete")
    factor = rope.opt("factor", cfg.opt("max_position_embeddings", 2048, int) / original, float)
    rope.require(factor > 0, "factor", factor, "a positive rope scaling factor")
    attention = rope.opt("attention_factor", None, float)
    rope.require(attention is None or attention > 0, "attention_factor", attention, "a positive number")
    spec = RopeSpec(dim=dim, theta=theta, kind="longrope", factor=factor, original_max_position=original,
                    attention_factor=attention, freq_factors=factors["short_factor"])
    return spec, factors["long_factor"]


def sliding_windows(cfg: Config, n_layers: int) -> list[int | None]:
    """Per layer, the sliding window or None, from `layer_types` or `use_sliding_window`."""
    window = cfg.opt("sliding_window", None, int)
    types = cfg.opt("layer_types", None, list)
    if types is None:
        if not cfg.opt("use_sliding_window", False, bool) or not window:
            return [None] * n_layers
        first = cfg.opt("max_window_layers", n_layers, int)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    if len(types) != n_layers:
        raise ModelFormatError(f"{cfg.source}: 'layer_types' has {len(types)} entries for {n_layers} layers; {FIX}")
    if window is not None and window < 0:
        raise cfg.invalid("sliding_window", window, "a window of positions >= 1 (or 0 / null for none)")
    return [window if t == "sliding_attention" and window else None for t in types]


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
    if cfg.data.get("head_dim") is None:     # then heads split the hidden size
        cfg.require(hidden % n_heads == 0, "num_attention_heads", n_heads, f"a divisor of hidden_size {hidden}")
    head_dim = cfg.opt("head_dim", hidden // n_heads, int)
    if n_heads % n_kv:
        raise ModelFormatError(f"{cfg.source}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads "
                               f"{n_kv}; {FIX}")
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
    mlp = dense_mlp(cfg, cfg.opt("hidden_act", "silu", str))
    return tuple(LayerSpec(gqa_attention(cfg, sliding_window=windows[i], **attn), mlp) for i in range(n))


def dense_mlp(cfg: Config, act: str) -> MLPSpec:
    """The dense MLP of `intermediate_size` (which MoE configs may leave 0: checked only where a layer is dense)."""
    size = cfg.req("intermediate_size")
    cfg.require(size > 0, "intermediate_size", size, "a positive size for the dense layers")
    return MLPSpec(intermediate=size, act=act)


def moe_counts(cfg: Config, n_experts: int, top_k: int, experts_key: str) -> None:
    """Check a routed block's expert count against its top-k."""
    cfg.require(n_experts >= 1, experts_key, n_experts, "at least one expert")
    cfg.require(top_k <= n_experts, "num_experts_per_tok", top_k, f"at most the {n_experts} experts ({experts_key})")


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
        eos_token_ids=_eos(cfg),
    )


def _eos(cfg: Config) -> tuple[int, ...]:
    value = cfg.data.get("eos_token_id")
    ids = value if isinstance(value, list) else [] if value is None else [value]
    cfg.require(all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids), "eos_token_id", value,
                "a token id or a list of them")
    return eos_ids(value)

