"""Model families, one module each, found through a registry keyed by the checkpoint's architecture.

A family module exposes `ARCHITECTURES` (the names a config.json's `architectures` lists),
`spec_from_config(cfg, architecture) -> ModelSpec` and `ignored_tensors(cfg)`: the patterns of tensors
its checkpoints may carry that the model legitimately never reads (any other unused tensor is refused at
open: a checkpoint that does not match its config). A family whose checkpoints fuse several tensors in
one (all experts in a 3-D tensor, gate and up together) also exposes `fused_tensors(cfg)`: the
`engine.formats.fused.FusedTensor` rules that cut them into the names the engine reads. The shared
`transformer` runs them all.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any, Mapping

from engine.errors import ModelFormatError, UnsupportedArchitectureError
from engine.models import (
    deepseek,
    deepseek_v2,
    ernie,
    gemma,
    glm4_moe,
    glm4_moe_lite,
    glm_moe_dsa,
    gpt_oss,
    granitemoe,
    kimi_linear,
    llama,
    minimax_m2,
    mistral,
    mixtral,
    olmo2,
    olmoe,
    phi3,
    phimoe,
    qwen2,
    qwen3,
    qwen3_5_moe,
    qwen3_next,
    qwen_moe,
)
from engine.models.config import Config
from engine.spec import ModelSpec

FAMILIES: dict[str, ModuleType] = {
    arch: module
    for module in (llama, qwen2, qwen3, mixtral, qwen_moe, olmoe, deepseek, gpt_oss, granitemoe, deepseek_v2, glm4_moe,
                   glm4_moe_lite, qwen3_next, glm_moe_dsa, phi3, mistral, gemma, olmo2, minimax_m2, ernie, phimoe,
                   qwen3_5_moe, kimi_linear)
    for arch in module.ARCHITECTURES
}


def supported_architectures() -> list[str]:
    """Every architecture name the engine runs."""
    return sorted(FAMILIES)


def _family(data: Mapping[str, Any], source: str) -> tuple[ModuleType, str]:
    """The family module of a config.json dict, and its architecture name."""
    archs = data.get("architectures") or []
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ModelFormatError(f"{source}: no 'architectures' list of names; cannot tell which model this is")
    arch = archs[0]
    family = FAMILIES.get(arch)
    if family is None:
        raise UnsupportedArchitectureError(
            f"{source}: architecture {arch!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    return family, arch


def spec_from_config(data: Mapping[str, Any], source: str = "config.json") -> ModelSpec:
    """Parse a config.json dict into a ModelSpec through its family's module."""
    family, arch = _family(data, source)
    return family.spec_from_config(Config(data, source), arch)


def ignored_tensors(data: Mapping[str, Any], source: str = "config.json") -> re.Pattern:
    """What a checkpoint of this config may carry unused (its family's allow-list), as one pattern."""
    family, _ = _family(data, source)
    return re.compile("|".join(f"(?:{p})" for p in family.ignored_tensors(Config(data, source))) or "(?!)")


def fused_tensors(data: Mapping[str, Any], source: str = "config.json") -> tuple:
    """How this config's checkpoints fuse tensors (its family's `FusedTensor` rules; none for most families)."""
    family, _ = _family(data, source)
    rules = getattr(family, "fused_tensors", None)      # optional: only families with fused checkpoints define it
    return tuple(rules(Config(data, source))) if rules is not None else ()


def mtp_spec(data: Mapping[str, Any], source: str = "config.json") -> ModelSpec | None:
    """The one-layer spec of this config's multi-token-prediction module (its decoder layer), or None when the
    family has none or the config counts none (`num_nextn_predict_layers`)."""
    family, arch = _family(data, source)
    make = getattr(family, "mtp_spec", None)      # optional: only families whose checkpoints ship MTP layers
    return make(Config(data, source), arch) if make is not None else None
