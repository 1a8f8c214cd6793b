"""How a model loads, planned from typed options: held whole, or with its weights offloaded to disk under a
memory budget, and the KV cache it runs on.

`plan_load` is a pure function of the `LoadOptions`, the model's spec and its container: the budget is divided
(engine.offload.budget) into resident weights, KV cache, working buffers and the memory for offloaded weights,
and the result is a frozen `LoadPlan` (the engine's `OffloadOptions`, the split, the KV settings and the line a
command shows). It prints nothing; the CLI (app/commands) and the engine service (app/service/local.py) both use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.service.messages import LoadOptions
from engine.errors import ColibriError

if TYPE_CHECKING:
    from engine.formats.container import Container
    from engine.kv import KVCache, KVPool
    from engine.loader import OffloadOptions
    from engine.offload.budget import MemoryPlan
    from engine.spec import ModelSpec

DEFAULT_CONTEXT = 4096      # context length when the options name none (capped by the model's own limit)


def speculative_settings(loaded, mode: bool | str, draft: int | None = None):
    """The engine's SpeculativeSettings for `--speculative` (True: prompt lookup, "mtp": the checkpoint's MTP head,
    opened here) and `--draft` K; None when mode is off. Raises ColibriError naming what is wrong."""
    if not mode:
        return None
    from engine.generation.speculative import SpeculativeSettings

    mtp = None
    if mode == "mtp":
        from engine.loader import load_mtp

        mtp = load_mtp(loaded.path, loaded.spec)
    # one MTP layer is trained for the next token but one: further guesses feed on its own state
    k = draft if draft is not None else (1 if mtp is not None else 4)
    settings = SpeculativeSettings(max_draft=k, mtp=mtp)
    try:
        settings.validate()
    except ColibriError as exc:
        raise ColibriError(f"--draft {k}: {exc}") from None
    return settings


@dataclass(frozen=True)
class KVOptions:
    """How the KV cache stores positions: block size, bits per value, and what happens past the context."""

    block_size: int
    bits: int = 32              # 32 exact; 16 fp16 rows; 8 int8 rows
    overflow: str = "error"     # "error", "slide" or "retain" (see engine.kv)

    @classmethod
    def of(cls, options: LoadOptions) -> KVOptions:
        """The KV settings of a load, checked."""
        from engine.kv import BLOCK_SIZE, check_kv_settings

        kv = cls(options.kv_block_size or BLOCK_SIZE, options.kv_bits, options.overflow)
        check_kv_settings(kv.block_size, kv.bits, kv.overflow)
        return kv


@dataclass(frozen=True)
class LoadPlan:
    """What a load will do: the model, its context, its KV cache and, under a budget, how weights are offloaded."""

    path: Path
    spec: ModelSpec
    context_length: int
    kv: KVOptions
    offload: OffloadOptions | None = None   # None: the model is held whole
    memory: MemoryPlan | None = None        # how the budget divides (None: held whole, no budget)
    description: str = ""                   # the budget's split, for a command to show ("" when held whole)

    @property
    def budget(self) -> int | None:
        """Bytes for the whole model, or None when it is held whole."""
        return self.memory.total if self.memory is not None else None


def needs_container(path: Path) -> ColibriError:
    """The error for a budget given to a model that is not a Colibri container."""
    return ColibriError(f"{path}: --max-memory streams from a Colibri container; convert the model first: "
                        f"`colibri convert {path} OUT --bits 4`, then run OUT")


def plan_load(options: LoadOptions, path: Path, spec: ModelSpec, container: Container | None, *,
              available: int | None = None, history_dir: Path | None = None) -> LoadPlan:
    """The plan for loading the model at `path` with `options` (raises ColibriError naming what to change).

    `available`: free memory in bytes, from which a budget is chosen when the options offload without naming
    one (None: all that the model needs); `history_dir`: the folder of usage histories (None: no history)."""
    from app.service.model import ALL, full_budget, n_experts
    from engine.loader import OffloadOptions
    from engine.offload.budget import plan_memory
    from engine.offload.store_types import StoreSettings

    kv = KVOptions.of(options)
    ctx = options.context_length or min(spec.max_position, DEFAULT_CONTEXT)
    if not 1 <= ctx <= spec.max_position:
        raise ColibriError(f"context length {ctx}: the model supports 1 to {spec.max_position} tokens")
    if options.prefetch_depth < 0:
        raise ColibriError(f"--prefetch-depth {options.prefetch_depth}: use 0 (off) or more")
    budget = options.max_memory
    wants = options.offload if options.offload is not None else (container is not None and n_experts(spec) > 0)
    if budget is None and wants and container is not None:
        full = full_budget(plan_memory(container, spec, ALL, ctx, options.prefetch_depth))
        least = plan_memory(container, spec, full, ctx, options.prefetch_depth).minimum
        budget = full if available is None else max(least, min(full, int(available * 0.75)))
    if budget is None:
        if options.offload:
            raise ColibriError(f"{path.name}: streaming needs a memory budget (max_memory)")
        return LoadPlan(path, spec, ctx, kv)
    if container is None:
        raise needs_container(path)
    memory = plan_memory(container, spec, budget, ctx, options.prefetch_depth, options.resident_layers,
                         options.kv_bits)
    settings = StoreSettings(capacity=memory.cache, io=options.io, io_threads=options.io_threads,
                             policy=options.cache_policy)
    settings.check()
    history = history_dir / f"{container.model_hash}.npz" if options.history and history_dir is not None else None
    offload = OffloadOptions(settings, options.prefetch_depth, history, memory.resident_layers or 0)
    return LoadPlan(path, spec, ctx, kv, offload, memory, f"memory budget {memory.describe()}")


def plan_offload(options: LoadOptions, path: Path, history_dir: Path | None = None) -> LoadPlan:
    """`plan_load` for a container at `path` given a budget (reads its manifest; refuses anything else)."""
    from engine.formats.container import is_container
    from engine.loader import open_checkpoint

    if not (Path(path).is_dir() and is_container(path)):
        raise needs_container(path)
    ckpt = open_checkpoint(path, verify=False)           # the loader checks what it holds
    return plan_load(options, Path(path), ckpt.spec, ckpt.source, history_dir=history_dir)


def kv_pool(spec: ModelSpec, kv: KVOptions, ctx: int, sequences: int = 1, prefix_cache: bool = True) -> KVPool:
    """A KV pool holding `sequences` contexts of `ctx` tokens (plus one spare block each)."""
    from engine.kv import KVPool, blocks_for

    return KVPool(spec, sequences * (blocks_for(ctx, kv.block_size) + 1), kv.block_size, kv.bits,
                  prefix_cache=prefix_cache)


def kv_cache(spec: ModelSpec, kv: KVOptions, ctx: int, pool: KVPool | None = None) -> KVCache:
    """One sequence's cache (its own pool unless one is given)."""
    from engine.kv import KVCache

    pool = pool if pool is not None else kv_pool(spec, kv, ctx, prefix_cache=False)
    return KVCache(spec, ctx, pool=pool, overflow=kv.overflow)
