"""Model families, one module each, found through a registry keyed by the checkpoint's architecture.

A family module exposes `ARCHITECTURES` (the names a config.json's `architectures` lists) and
`spec_from_config(cfg, architecture) -> ModelSpec`; the shared `transformer` runs them all.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Mapping

from engine.errors import ModelFormatError, UnsupportedArchitectureError
from engine.models import deepseek, llama, mixtral, olmoe, qwen2, qwen3, qwen_moe
from engine.models.config import Config
from engine.spec import ModelSpec

FAMILIES: dict[str, ModuleType] = {
    arch: module
    for module in (llama, qwen2, qwen3, mixtral, qwen_moe, olmoe, deepseek)
    for arch in module.ARCHITECTURES
}


def supported_architectures() -> list[str]:
    """Every architecture name the engine runs."""
    return sorted(FAMILIES)


def spec_from_config(data: Mapping[str, Any], source: str = "config.json") -> ModelSpec:
    """Parse a config.json dict into a ModelSpec through its family's module."""
    archs = data.get("architectures") or []
    if not archs:
        raise ModelFormatError(f"{source}: no 'architectures' entry; cannot tell which model this is")
    arch = archs[0]
    family = FAMILIES.get(arch)
    if family is None:
        raise UnsupportedArchitectureError(
            f"{source}: architecture {arch!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    return family.spec_from_config(Config(data, source), arch)
