"""Qwen3: GQA with an RMSNorm on each head's q and k, explicit head_dim, no q/k/v bias by default."""

from __future__ import annotations

from engine.models.config import ROPE_BUFFERS, Config, dense_layers, model_fields
from engine.spec import ModelSpec

ARCHITECTURES = ("Qwen3ForCausalLM",)


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a Qwen3 config.json."""
    bias = cfg.opt("attention_bias", False, bool)
    layers = dense_layers(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head")
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg))


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read."""
    return ROPE_BUFFERS
