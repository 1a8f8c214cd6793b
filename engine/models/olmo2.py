"""OLMo 2: norms after attention and after the MLP (none before them), q/k RMSNorms over the whole
projections, a dense SwiGLU MLP."""

from __future__ import annotations

import dataclasses

from engine.models.config import ROPE_BUFFERS, Config, dense_mlp, gqa_attention, model_fields
from engine.spec import LayerSpec, ModelSpec

ARCHITECTURES = ("Olmo2ForCausalLM",)
DEFAULTS = dict(eos_token_id=50279, rms_norm_eps=1e-5, max_position_embeddings=2048)   # the reference's, where config.json has none


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of an OLMo 2 config.json."""
    cfg = Config({**DEFAULTS, **cfg.data}, cfg.source)
    bias = cfg.opt("attention_bias", False, bool)
    attn = gqa_attention(cfg, qkv_bias=bias, o_bias=bias, qk_norm="full")
    attn = dataclasses.replace(attn, clip_qkv=None)      # OLMo 2 reads no clip_qkv (OLMoE does)
    mlp = dense_mlp(cfg, cfg.opt("hidden_act", "silu", str))
    layers = tuple(LayerSpec(attn, mlp, norms="post") for _ in range(cfg.req("num_hidden_layers")))
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg))


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints may carry that the model does not read."""
    return ROPE_BUFFERS
