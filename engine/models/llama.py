"""Llama (and SmolLM2, which is a Llama): GQA + RoPE (default, linear, llama3), dense SwiGLU MLP."""

from __future__ import annotations

from engine.errors import ModelFormatError
from engine.models.config import ROPE_BUFFERS, Config, dense_layers, model_fields
from engine.spec import ModelSpec

ARCHITECTURES = ("LlamaForCausalLM",)


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a Llama config.json."""
    if cfg.opt("mlp_bias", False, bool):
        raise ModelFormatError(f"{cfg.source}: mlp_bias=true is not supported for {architecture}")
    bias = cfg.opt("attention_bias", False, bool)
    layers = dense_layers(cfg, qkv_bias=bias, o_bias=bias)
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg))


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read."""
    return ROPE_BUFFERS
