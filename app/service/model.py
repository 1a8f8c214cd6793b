"""The engine service's loaded model (engine thread only): what it tells front ends (`ModelInfo`),
the live settings it applies between tokens, the gauges and expert tiers it publishes.

A model held whole has no budget to change; a dense model's layer store keeps what it was opened
with; an expert store resizes, and its budget is divided again (engine.offload.budget) whenever
the budget or the context length moves.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from app.service.messages import (
    TIER_CACHED,
    TIER_DISK,
    TIER_NONE,
    TIER_PINNED,
    TIER_RESIDENT,
    EngineSettings,
    ModelInfo,
    SettingsChange,
)
from engine.blocks.ffn import StreamingExpertSource
from engine.errors import ColibriError
from engine.offload.quality import CacheTrace
from engine.offload.story import ExpertCounts
from engine.spec import ModelSpec, MoESpec
from engine.telemetry import Telemetry

log = logging.getLogger(__name__)

RSS_INTERVAL = 0.25     # seconds between resident-memory gauge readings during generation
ALL = 1 << 62           # a budget no model reaches: plan_memory then holds every expert


@dataclass
class Engaged:
    """The model the engine thread holds, with its telemetry and what the front ends were told."""

    loaded: Any                         # engine.loader.LoadedModel
    telemetry: Telemetry
    info: ModelInfo
    container: Any = None               # the Container its store streams from
    rss_at: float = 0.0                 # when the rss gauge was last read
    base_tiers: np.ndarray | None = None  # [L, E] int8 tiers before any expert is read (built on first use)
    options: Any = None                 # app.service.messages.LoadOptions it was opened with
    pool: Any = None                    # engine.kv.KVPool for the context length in force (made on first use)
    scheduler: Any = None               # engine.generation.scheduler.Scheduler on that pool
    dense_bytes: int | None = None      # weights held in memory whatever the budget (None: not known)
    drafting: dict = field(default_factory=dict)   # drafting mode (True: lookup, "mtp") -> its SpeculativeSettings

    def speculation(self, asked: bool | str | None = None):
        """The SpeculativeSettings a generation runs with: the load's `speculative` option, unless the request asks
        (True: drafting on, by the load's mode or else prompt lookup; "lookup": prompt lookup; "mtp": the model's MTP
        head; False: off). None decodes plainly. Raises ColibriError when the mode cannot be had (no MTP layers)."""
        from app.service.loading import speculative_settings

        o = self.options
        on = o.speculative if asked is None else asked
        if not on:
            return None
        if isinstance(on, str) and on not in ("lookup", "mtp"):
            raise ColibriError(f"speculative {on!r}: ask for \"lookup\" (prompt lookup), \"mtp\", true or false")
        mode = "mtp" if on == "mtp" or (on is True and o.speculative == "mtp") else True
        if mode not in self.drafting:
            self.drafting[mode] = speculative_settings(self.loaded, mode, o.draft if mode == (o.speculative or mode) else None)
        return self.drafting[mode]

    def batcher(self):
        """The scheduler that runs this model's generations together, on a KV pool of `max_batch` contexts
        (blocks are committed only when written). Full blocks stay indexed, so the next turn of a chat (or
        any prompt with the same beginning) starts from them. Remade for a new context length only while
        idle: a running generation keeps the cache it started with."""
        from engine.generation.scheduler import Scheduler
        from engine.kv import BLOCK_SIZE, KVPool, blocks_for, check_kv_settings

        ctx, o = self.info.settings.context_length, self.options
        if self.scheduler is not None and (self.scheduler.busy or self.scheduler.max_len == ctx):
            return self.scheduler
        block = o.kv_block_size or BLOCK_SIZE
        check_kv_settings(block, o.kv_bits, o.overflow)
        self.scheduler = self.pool = None   # the old mappings go before the new ones are made
        self.pool = KVPool(self.loaded.spec, o.max_batch * (blocks_for(ctx, block) + 1), block, o.kv_bits)
        loaded = self.loaded
        self.scheduler = Scheduler(loaded.model, self.pool, max_len=ctx, tokenizer=loaded.tokenizer,
                                   stop_ids=loaded.stop_ids, max_batch=o.max_batch, overflow=o.overflow)
        return self.scheduler

    @classmethod
    def open(cls, loaded, telemetry: Telemetry, settings: EngineSettings, options=None) -> Engaged:
        """Describe a freshly loaded model."""
        from app.service.messages import LoadOptions
        from engine.offload.budget import plan_memory

        container = loaded.store.container if loaded.store is not None else None   # the one its store reads
        dense = None
        if container is not None:
            dense = plan_memory(container, loaded.spec, ALL, settings.context_length, settings.prefetch_depth).resident
        return cls(loaded, telemetry, model_info(loaded, container, settings), container,
                   options=options if options is not None else LoadOptions(), dense_bytes=dense)

    # --- live settings ---

    def apply(self, change: SettingsChange) -> list[str]:
        """Apply what can be applied (between tokens); return why the rest cannot."""
        from engine.offload.budget import plan_memory

        problems: list[str] = []
        info, loaded = self.info, self.loaded
        s, store, spec = info.settings, loaded.store, loaded.spec

        def refused(name: str) -> bool:
            why = info.fixed.get(name)
            if why:
                problems.append(why)
            return bool(why)

        if change.context_length is not None and change.context_length != s.context_length:
            ctx = change.context_length
            if not 1 <= ctx <= spec.max_position:
                problems.append(f"context length {ctx}: {info.name} supports 1 to {spec.max_position} tokens")
            else:
                try:
                    if info.streaming == "experts":  # the KV cache's share of the budget moves the expert cache's
                        store.set_capacity(plan_memory(self.container, spec, s.memory_budget, ctx,
                                                       s.prefetch_depth).cache)
                    s = replace(s, context_length=ctx)
                except ColibriError as exc:
                    problems.append(str(exc))
        depth = change.prefetch_depth
        if depth is not None and depth != s.prefetch_depth and not refused("prefetch_depth"):
            if depth < 0:
                problems.append(f"prefetch depth {depth}: use 0 (off) or more layers")
            else:
                loaded.model.context.prefetch_depth = depth
                s = replace(s, prefetch_depth=depth)
        if change.io_threads is not None and change.io_threads != s.io_threads and not refused("io_threads"):
            try:
                store.set_io_threads(change.io_threads)
                s = replace(s, io_threads=change.io_threads)
            except ColibriError as exc:
                problems.append(str(exc))
        budget = change.memory_budget
        if budget is not None and budget != s.memory_budget and not refused("memory_budget"):
            try:
                store.set_capacity(plan_memory(self.container, spec, budget, s.context_length, s.prefetch_depth).cache)
                s = replace(s, memory_budget=budget)
            except ColibriError as exc:
                problems.append(str(exc))
        info = replace(info, settings=s)
        self.info = replace(info, budget_range=budget_range(loaded, self.container, info))
        return problems

    # --- what the inspector reads ---

    def set_gauges(self) -> None:
        """The figures the Overview shows, as telemetry gauges (committed by the next end_token or flush)."""
        tel, s = self.telemetry, self.info.settings
        if s.memory_budget is not None:
            tel.set_gauge("budget", s.memory_budget)
        if self.info.streaming == "experts":
            store = self.loaded.store
            tel.set_gauge("expert_cache", store.settings.capacity)
            for tier, nbytes in store.stats().occupancy.items():
                tel.set_occupancy(tier, nbytes)
        tel.set_gauge("context_length", s.context_length)
        tel.set_gauge("prefetch_depth", s.prefetch_depth)
        tel.set_gauge("io_threads", s.io_threads)
        if self.dense_bytes is not None:
            tel.set_gauge("dense_bytes", self.dense_bytes)
        if s.memory_budget is not None:   # planned, not measured: the largest buffers a prompt chunk makes
            from engine.offload.budget import working_bytes

            tel.set_gauge("working_bytes", working_bytes(self.loaded.spec, s.context_length))
        self.gauge_kv()
        self.rss_at = 0.0
        self.gauge_rss()

    def kv_limit(self) -> int | None:
        """The KV cache's share of the memory budget in bytes (what plan_memory set aside); None without a budget."""
        from engine.offload.budget import kv_bytes

        s = self.info.settings
        if s.memory_budget is None or self.pool is None:
            return None
        return kv_bytes(self.loaded.spec, s.context_length, 32, self.pool.block_size)

    def gauge_kv(self) -> None:
        """Hold the KV pool to its share of the budget, then gauge it (between steps). Earlier chats' prefixes stay
        cached for reuse only while they fit: the least recently used go first, blocks in use never."""
        pool = self.pool
        if pool is None:
            return
        limit = self.kv_limit()
        if limit is not None:
            pool.trim_cached(limit)
        self.telemetry.set_gauge("kv_bytes", pool.nbytes)

    def gauge_rss(self) -> None:
        """Refresh the rss gauge, at most every RSS_INTERVAL seconds."""
        now = time.monotonic()
        if now - self.rss_at >= RSS_INTERVAL:
            self.rss_at = now
            value = rss()
            if value is not None:
                self.telemetry.set_gauge("rss", value)

    def cache_trace(self) -> CacheTrace | None:
        """The expert cache's recent trace for the cache-quality meter (engine/offload/quality.py); None unless
        experts are streamed."""
        store = self.loaded.store
        if self.info.streaming != "experts" or store is None:
            return None
        return store.cache_trace()

    def expert_counts(self) -> ExpertCounts | None:
        """Each streamed expert's counters and latest tier changes (engine/offload/story.py); None unless experts are
        streamed."""
        store = self.loaded.store
        if self.info.streaming != "experts" or store is None:
            return None
        return store.expert_counts()

    def tiers(self) -> np.ndarray | None:
        """Each expert's tier now, int8 [L, E] (TIER_* codes); None without routed experts or with a layer store."""
        info, store = self.info, self.loaded.store
        if info.n_experts == 0 or info.streaming == "layers":
            return None
        if self.base_tiers is None:    # every expert on disk (streamed) or resident (held whole)
            base = np.full((info.n_layers, info.n_experts), TIER_NONE, np.int8)      # [L, E]
            keys = list(store.recipes) if store is not None else [
                (i, e) for i, layer in enumerate(self.loaded.spec.layers) if isinstance(layer.ffn, MoESpec)
                for e in range(layer.ffn.n_experts)]
            for i, e in keys:
                base[i, e] = TIER_DISK if store is not None else TIER_RESIDENT
            base.flags.writeable = False
            self.base_tiers = base
        if store is None:
            return self.base_tiers
        grid = self.base_tiers.copy()
        for i, e in list(store.built):
            grid[i, e] = TIER_PINNED if (i, e) in store.pinned else TIER_CACHED
        grid.flags.writeable = False
        return grid


# ---- describing a model ------------------------------------------------------------------------------


def n_experts(spec: ModelSpec) -> int:
    """The most routed experts of any layer (0: dense)."""
    return max((layer.ffn.n_experts for layer in spec.layers if isinstance(layer.ffn, MoESpec)), default=0)


def top_k(spec: ModelSpec) -> int:
    """The most experts a token uses in any layer (0: dense)."""
    return max((layer.ffn.top_k for layer in spec.layers if isinstance(layer.ffn, MoESpec)), default=0)


def peek_spec(path: Path) -> ModelSpec:
    """The model's spec without building anything: config.json of a folder, the metadata of a GGUF."""
    from engine.formats.hf import read_json
    from engine.loader import open_checkpoint
    from engine.models import spec_from_config

    if path.is_dir():
        return spec_from_config(read_json(path / "config.json", "config.json"), str(path / "config.json"))
    return open_checkpoint(path, verify=False, verify_experts=False).spec


def full_budget(plan) -> int:
    """The budget of a MemoryPlan at which every expert stays in memory once read."""
    return plan.resident + plan.kv + plan.working + plan.cache


def budget_range(loaded, container, info: ModelInfo) -> tuple[int, int] | None:
    """(least budget, budget holding every expert) at the current context, for an expert store."""
    from engine.offload.budget import plan_memory

    if info.streaming != "experts":
        return None
    s, spec = info.settings, loaded.spec
    full = full_budget(plan_memory(container, spec, ALL, s.context_length, s.prefetch_depth))
    try:
        least = plan_memory(container, spec, full, s.context_length, s.prefetch_depth).minimum
    except ColibriError:
        least = full
    return least, max(full, least)


def model_info(loaded, container, settings: EngineSettings) -> ModelInfo:
    """What front ends are told of a loaded model, and why a setting cannot change."""
    spec, store = loaded.spec, loaded.store
    fixed: dict[str, str] = {}
    if store is None:
        streaming = ""
        why = (f"{loaded.name} is held whole in memory: to run it under a budget, convert it (`colibri convert`) "
               "and open the container with a memory budget")
        fixed.update(memory_budget=why, prefetch_depth="nothing is read ahead: " + why, io_threads=why)
    elif isinstance(store, StreamingExpertSource):
        streaming = "experts"
    else:
        streaming = "layers"
        why = ("a dense model's layer store keeps the budget, read-ahead and readers it was opened with; "
               "reopen the model to change them")
        fixed.update(memory_budget=why, prefetch_depth=why, io_threads=why)
    info = ModelInfo(Path(loaded.path), loaded.name, spec.architecture, spec.n_layers, n_experts(spec), top_k(spec),
                     bool(loaded.tokenizer is not None and loaded.tokenizer.has_chat_template), spec.max_position,
                     streaming, None, MappingProxyType(fixed), settings, spec.vocab_size, has_mtp(loaded.path))
    return replace(info, budget_range=budget_range(loaded, container, info))


def has_mtp(path: Path) -> bool:
    """Whether the checkpoint at path declares MTP layers to draft with (its config.json; a GGUF file has none)."""
    import json

    from engine.models import mtp_spec

    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return mtp_spec(json.loads(config.read_text(encoding="utf-8")), str(config)) is not None
    except (OSError, ValueError, ColibriError):
        return False


def read_atlas(path: Path) -> Mapping[str, Any] | None:
    """The atlas sidecar bound to this model, or None (absent, unreadable or another model's)."""
    from app.atlas.build import default_sidecar
    from app.atlas.build import read_atlas as read

    sidecar = default_sidecar(path)
    if not sidecar.is_file():
        return None
    try:
        return read(sidecar, path)
    except ColibriError as exc:
        log.warning("atlas %s not used: %s", sidecar, exc)
        return None


def rss() -> int | None:
    """Resident memory of this process in bytes (Linux), or None."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (Linux), or None."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
