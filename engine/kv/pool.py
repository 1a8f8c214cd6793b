"""The KV block pool: blocks of every layer's keys and values, reference counted, indexed by prefix hash.

What a block holds per layer (`block_bytes`, `blocks_for`), the settings the cache accepts (`check_kv_settings`),
and `KVPool`: anonymous mappings committed as blocks are written and handed back as they are freed, the prefix
index of full blocks (`prefix_digest`) with least-recently-used eviction of cached ones, and the rows a
sliding-window layer no longer needs.
"""

from __future__ import annotations

import hashlib
import mmap
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.errors import ColibriError, GenerationError
from engine.pages import MAP_NORESERVE
from engine.recurrent import Checkpoints
from engine.spec import GatedDeltaNetSpec, MLASpec, ModelSpec

BLOCK_SIZE = 32           # positions per block: small blocks slow decode attention (`colibri bench --kv blocks`),
                          # large ones coarsen prefix sharing; 32 sits where neither costs
OVERFLOW = ("error", "slide", "retain")
KV_BITS = (32, 16, 8)     # how keys and values are stored: float32, fp16, int8 with a float32 scale per row
PAGE = 4096


class KVFullError(GenerationError):
    """The pool has no free block and nothing cached to evict."""


@dataclass(frozen=True)
class _Part:
    """One array of a layer inside a block: its name, shape per block and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


def _layer_parts(attn, block: int, bits: int) -> list[_Part]:
    store = np.dtype({8: np.int8, 16: np.uint16}.get(bits, np.float32))   # fp16 rows as their bits
    f32 = np.dtype(np.float32)
    if isinstance(attn, GatedDeltaNetSpec):    # a recurrent state per sequence (LayerState), nothing per position
        return []
    if isinstance(attn, MLASpec):
        parts = [_Part("k", (block, attn.kv_lora_rank), store), _Part("ks", (block,), f32),
                 _Part("v", (block, attn.qk_rope_dim), store), _Part("vs", (block,), f32)]
        if attn.indexer is not None and not attn.indexer.shared:   # the sparse-attention indexer's own keys
            parts += [_Part("ik", (block, attn.indexer.head_dim), store), _Part("iks", (block,), f32)]
        return parts
    h, d = attn.n_kv_heads, attn.head_dim
    return [_Part("k", (h, block, d), store), _Part("ks", (h, block), f32),
            _Part("v", (h, block, d), store), _Part("vs", (h, block), f32)]


def block_bytes(spec: ModelSpec, block_size: int = BLOCK_SIZE, bits: int = 32) -> int:
    """Bytes one block of every layer takes."""
    return sum(int(np.prod(part.shape)) * part.dtype.itemsize
               for layer in spec.layers for part in _layer_parts(layer.attn, block_size, bits))


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks a sequence of `tokens` positions needs."""
    return -(-int(tokens) // block_size)


def check_kv_settings(block_size: int, bits: int, overflow: str) -> None:
    """Refuse settings the cache cannot honour, naming the allowed values."""
    if not isinstance(block_size, int) or not 1 <= block_size <= 1024 or block_size & (block_size - 1):
        raise ColibriError(f"KV block size {block_size}: use a power of two from 1 to 1024 (default {BLOCK_SIZE})")
    if bits not in KV_BITS:
        raise ColibriError(f"KV bits {bits}: use 32 (float32, exact), 16 (fp16, half the memory) or 8 (int8 with a "
                           "scale per row, a quarter)")
    if overflow not in OVERFLOW:
        raise ColibriError(f"overflow {overflow!r}: use one of {', '.join(OVERFLOW)}")


class KVPool:
    """Blocks of KV for every layer of one model, shared by its sequences.

    `n_blocks` bounds the pool; memory is committed only as blocks are written and returned when
    they are freed. `prefix_cache` indexes full blocks by their prefix hash so that sequences share them.
    """

    def __init__(self, spec: ModelSpec, n_blocks: int, block_size: int = BLOCK_SIZE, bits: int = 32,
                 prefix_cache: bool = True):
        check_kv_settings(block_size, bits, "error")
        if n_blocks < 1:
            raise ColibriError(f"a KV pool of {n_blocks} blocks holds nothing; it needs at least one")
        self.spec, self.block_size, self.bits, self.n_blocks = spec, block_size, bits, int(n_blocks)
        self.prefix_cache = prefix_cache
        # sliding-window layers by window: group g's layers attend to the last windows[g] positions only
        self.windows = tuple(sorted({w for layer in spec.layers if (w := getattr(layer.attn, "sliding_window", None))}))
        self.group = [self.windows.index(w) if (w := getattr(layer.attn, "sliding_window", None)) else -1
                      for layer in spec.layers]
        self.need = np.zeros((len(self.windows), self.n_blocks), np.int32)   # holders still attending to a block
        self.dropped = np.zeros((len(self.windows), self.n_blocks), bool)    # the group's rows of a block are gone
        self.rope = [None if isinstance(layer.attn, GatedDeltaNetSpec) else layer.attn.rope for layer in spec.layers]
        self.latent = [isinstance(layer.attn, MLASpec) for layer in spec.layers]
        # one anonymous mapping per layer and array, reserved for every block and committed as blocks are
        # written: each array is C-contiguous [n_blocks, ...], so the kernels' inner loops run at unit stride
        self._maps: list[mmap.mmap] = []
        self.layers: list[dict[str, np.ndarray]] = []
        self._layer_maps: list[list[tuple[np.ndarray, mmap.mmap]]] = []   # per layer: its arrays and their maps
        for layer in spec.layers:
            arrays = {}
            self._layer_maps.append([])
            for part in _layer_parts(layer.attn, block_size, bits):
                size = self.n_blocks * int(np.prod(part.shape)) * part.dtype.itemsize
                m = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
                self._maps.append(m)
                arrays[part.name] = np.frombuffer(m, part.dtype, count=size // part.dtype.itemsize).reshape(
                    (self.n_blocks, *part.shape))
                self._layer_maps[-1].append((arrays[part.name], m))
            self.layers.append(arrays)
        self.block_bytes = block_bytes(spec, block_size, bits)
        self.group_bytes = [sum(int(np.prod(part.shape)) * part.dtype.itemsize
                                for j, layer in enumerate(spec.layers) if self.group[j] == g
                                for part in _layer_parts(layer.attn, block_size, bits))
                            for g in range(len(self.windows))]     # one block of each group's layers
        self.ref = np.zeros(self.n_blocks, np.int32)
        self.hashes: list[bytes | None] = [None] * self.n_blocks
        self.index: dict[bytes, int] = {}
        self.cached: OrderedDict[int, None] = OrderedDict()   # indexed blocks no sequence holds, oldest first
        self.free = list(range(self.n_blocks - 1, -1, -1))
        self.touched = np.zeros(self.n_blocks, bool)           # pages committed (written since last freed)
        self.hits = self.lookups = 0
        # recurrent layers' states at block boundaries of cached prefixes (what lets their sequences share one)
        self.checkpoints = Checkpoints(self) if spec.is_recurrent and prefix_cache else None

    # --- allocation ---

    def allocate(self) -> int:
        """A block for one sequence (reference count 1); evicts the least recently used cached prefix if needed."""
        if self.free:
            b = self.free.pop()
        elif self.cached:
            b, _ = self.cached.popitem(last=False)
            self._unindex(b)
        elif self.checkpoints is not None and self.checkpoints.evict_oldest():   # its blocks are free again
            b = self.free.pop()
        else:
            raise KVFullError(
                f"the KV cache is full: all {self.n_blocks} blocks of {self.block_size} positions are in use; "
                "raise --max-memory, lower --ctx, or run fewer requests at once")
        self.ref[b] = 1
        self.touched[b] = True
        self.need[:, b] = 0
        self.dropped[:, b] = False
        return b

    def retain(self, b: int) -> None:
        """One more holder of block b."""
        if self.ref[b] == 0:
            self.cached.pop(b, None)
        self.ref[b] += 1

    def release(self, b: int) -> None:
        """One holder fewer; an unheld block stays cached when indexed, else is freed (its pages returned)."""
        self.ref[b] -= 1
        if self.ref[b] > 0:
            return
        if self.hashes[b] is not None:
            self.cached[b] = None
        else:
            self._free(b)

    def _free(self, b: int) -> None:
        self.free.append(b)
        self.dropped[:, b] = False
        if self.touched[b]:
            self.touched[b] = False
            _discard(b, [pair for pairs in self._layer_maps for pair in pairs])

    def drop(self, g: int, b: int) -> None:
        """Give back the rows of block b in window group g's layers (no holder attends to them any more)."""
        self.dropped[g, b] = True
        _discard(b, [pair for j, pairs in enumerate(self._layer_maps) if self.group[j] == g for pair in pairs])

    def held_blocks(self, j: int) -> int:
        """Blocks (in use or cached) whose rows of layer j are kept: a sliding-window layer keeps its window."""
        held = self.n_blocks - len(self.free)
        return held - int(np.count_nonzero(self.dropped[self.group[j]])) if self.group[j] >= 0 else held

    def _unindex(self, b: int) -> None:
        h = self.hashes[b]
        if h is not None:
            self.hashes[b] = None
            if self.index.get(h) == b:
                del self.index[h]
                if self.checkpoints is not None:   # the prefix it ends can no longer be adopted
                    self.checkpoints.drop(h)

    def copy(self, src: int, without: Sequence[int] = ()) -> int:
        """A private copy of block src (copy on write), but for the rows of the window groups `without`
        (dropped in the copy)."""
        dst = self.allocate()
        for j, arrays in enumerate(self.layers):
            if self.group[j] < 0 or self.group[j] not in without:
                for a in arrays.values():
                    a[dst] = a[src]
        for g in without:
            self.drop(g, dst)
        return dst

    def drop_cached(self) -> None:
        """Forget every cached prefix (their blocks are freed) and every recurrent-state snapshot."""
        while self.cached:
            b, _ = self.cached.popitem(last=False)
            self._unindex(b)
            self._free(b)
        if self.checkpoints is not None:
            self.checkpoints.clear()

    def trim_cached(self, limit: int) -> int:
        """Free cached prefixes, least recently used first, until the pool holds at most `limit` bytes (or none
        is left); the blocks freed. Blocks in use stay: a memory budget bounds what earlier chats leave behind."""
        freed = 0
        while self.cached and self.nbytes > limit:
            b, _ = self.cached.popitem(last=False)
            self._unindex(b)
            self._free(b)
            freed += 1
        return freed

    # --- the prefix index ---

    def lookup(self, digest: bytes) -> int | None:
        """The block indexed under digest, if any."""
        self.lookups += 1
        b = self.index.get(digest)
        if b is not None:
            self.hits += 1
        return b

    def publish(self, b: int, digest: bytes) -> None:
        """Index a full block under its prefix hash (a block already indexed under it wins)."""
        if not self.prefix_cache or self.hashes[b] is not None or digest in self.index:
            return
        self.hashes[b] = digest
        self.index[digest] = b

    def unpublish(self, b: int) -> None:
        """Take block b out of the index (its contents are about to change)."""
        self._unindex(b)

    # --- figures ---

    @property
    def used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return int(np.count_nonzero(self.ref))

    @property
    def nbytes(self) -> int:
        """Bytes of blocks in use or cached (what the pool holds in memory), less the rows sliding-window layers
        dropped, and of the recurrent-state snapshots (in place of the blocks set aside for them)."""
        dropped = sum(int(np.count_nonzero(self.dropped[g])) * n for g, n in enumerate(self.group_bytes))
        held = self.n_blocks - len(self.free)
        if self.checkpoints is not None:
            return (held - self.checkpoints.reserved) * self.block_bytes - dropped + self.checkpoints.nbytes
        return held * self.block_bytes - dropped

    @property
    def capacity_bytes(self) -> int:
        """Bytes the pool may grow to."""
        return self.n_blocks * self.block_bytes

    def close(self) -> None:
        """Release the mappings (no sequence may use the pool afterwards)."""
        self.layers = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:   # pragma: no cover - a view is still alive; the mapping goes with it
                pass


def _discard(b: int, pairs: Sequence[tuple[np.ndarray, mmap.mmap]]) -> None:
    """Return the pages of block b in each (array, its map) to the system: they read as zeros afterwards."""
    for array, m in pairs:
        row = array[0].nbytes
        lo, hi = -(-b * row // PAGE) * PAGE, (b + 1) * row // PAGE * PAGE   # whole pages inside the block
        if hi > lo:
            try:
                m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (AttributeError, OSError):   # pragma: no cover - no madvise: pages stay until reused
                return


def prefix_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a block: its tokens and the hash of everything before it."""
    return hashlib.blake2b(parent + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


ROOT = b"colibri-kv-1"
