"""Mistral: Llama's layers with a sliding window on every layer when `sliding_window` is set, and `head_dim`."""

from __future__ import annotations

from engine.models.config import ROPE_BUFFERS, Config, dense_mlp, gqa_attention, model_fields
from engine.spec import LayerSpec, ModelSpec

ARCHITECTURES = ("MistralForCausalLM",)
# The reference's defaults where config.json leaves a key out (null keeps its meaning: no window, as many
# key/value heads as heads, head_dim from the hidden size)
DEFAULTS = dict(bos_token_id=1, eos_token_id=2,
                sliding_window=4096, num_key_value_heads=8, max_position_embeddings=4096 * 32, rms_norm_eps=1e-6)


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a Mistral config.json (`layer_types`, which the reference ignores, is ignored too)."""
    cfg = Config({**DEFAULTS, **cfg.data}, cfg.source)
    window = cfg.data["sliding_window"]
    if window is not None:
        window = cfg.req("sliding_window")
        cfg.require(window >= 1, "sliding_window", window, "a window of positions >= 1 (or null for none)")
    attn = gqa_attention(cfg, qkv_bias=False, o_bias=False, sliding_window=window)
    mlp = dense_mlp(cfg, cfg.opt("hidden_act", "silu", str))
    layers = tuple(LayerSpec(attn, mlp) for _ in range(cfg.req("num_hidden_layers")))
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg))


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read."""
    return ROPE_BUFFERS
