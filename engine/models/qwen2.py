"""Qwen2: Llama's layout with biases on q, k and v (not o), optional sliding-window layers."""

from __future__ import annotations

from engine.models.config import ROPE_BUFFERS, Config, dense_layers, model_fields
from engine.spec import ModelSpec

ARCHITECTURES = ("Qwen2ForCausalLM",)


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a Qwen2 config.json."""
    layers = dense_layers(cfg, qkv_bias=True, o_bias=False)
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg))


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read."""
    return ROPE_BUFFERS
