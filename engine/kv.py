"""The paged KV cache: a pool of fixed-size blocks shared by sequences, a prefix index, retention.

- `KVPool` holds, for every layer, keys and values (or, for multi-head latent attention, the
  compressed latent and the shared rotary key, plus the sparse-attention indexer's key where the
  layer has one) in blocks of `block_size` positions. Each layer's
  arrays are C-contiguous [n_blocks, ...] anonymous mappings, reserved up front but committed only
  as blocks are written; a block that is freed hands its pages back to the system.
- A full block is indexed by a hash of its tokens and of everything before it. A sequence that
  starts with the same tokens (a system prompt, earlier turns, the same document) takes those
  blocks instead of computing them again. Blocks are reference counted; unused indexed blocks stay
  cached and are evicted least recently used first when the pool needs room.
- `KVCache` is one sequence: its block table, its tokens, its length. Attention reads the blocks
  directly through the table (`engine.kernels.attention`).
- Past `max_len`, a sequence fails (`overflow="error"`, the default), or evicts whole blocks:
  the oldest (`"slide"`), or the block whose tokens drew the least attention so far while keeping
  the first tokens (attention sinks) and the recent window (`"retain"`). Either way the positions
  of the blocks after the evicted one move down (their rotary keys are rotated back), so positions
  stay inside the context the model knows. Both change outputs and are only on when asked.
- A recurrent layer (gated DeltaNet) has no blocks: its `LayerState` keeps the sequence's state (a
  convolution's last inputs and a recurrent matrix per head) after the held tokens, and after each
  token of a short step, so a sequence can go back into its last step (speculative drafts) but not
  further. Blocks alone cannot rebuild its state: the pool keeps snapshots of every recurrent layer's
  state at block boundaries (`engine.recurrent.Checkpoints`, charged blocks of the pool), and a sequence
  adopts a cached prefix only up to the longest boundary with a snapshot. Overflow past `max_len` is refused.
- `kv_bits=16` stores rows as fp16 (half the memory of float32, rounded to nearest); `kv_bits=8` as
  int8 with one float32 scale per row (per head for keys and values).
- A sliding-window layer needs only its window: once no sequence holding a block can attend to it any more
  in that layer (every holder's next query lies more than the window past it), the layer's rows of the block
  are dropped (their pages returned), while full-attention layers keep theirs. A sequence that truncates or
  adopts a prefix back to where a window's rows are gone holds less (the rest is computed again); retention
  evicts no block a window would reach again once the later blocks move down.
"""

from __future__ import annotations

import hashlib
import mmap
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.errors import ColibriError, GenerationError
from engine.kernels.attention import attend_latent, attend_paged
from engine.kernels.sparse import attend_selected, index_scores
from engine.recurrent import Checkpoints, State, own
from engine.spec import GatedDeltaNetSpec, MLASpec, ModelSpec, RopeSpec

BLOCK_SIZE = 32           # positions per block: small blocks slow decode attention (`colibri bench --kv blocks`),
                          # large ones coarsen prefix sharing; 32 sits where neither costs
OVERFLOW = ("error", "slide", "retain")
KV_BITS = (32, 16, 8)     # how keys and values are stored: float32, fp16, int8 with a float32 scale per row
SINK_TOKENS = 4           # retention: the first tokens always kept (attention sinks)
PAGE = 4096
KEEP_STEP = 16            # a recurrent layer keeps its state after each token of a step this short (drafts roll back)


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


def _rotate_back(x: np.ndarray, rope: RopeSpec, delta: int) -> None:
    """Rotate stored rotary features x [..., rows, >= rope.dim] in place by `delta` positions.

    Stored keys are rotated already and laid out as halves (the rotary layout the kernels use), so
    rotating again by delta moves them from position p to p + delta: R(delta) R(p) = R(p + delta).
    """
    d = rope.dim
    angles = np.float32(delta) * rope.inv_freq()                 # [d/2]
    c, s = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    a, b = x[..., : d // 2].copy(), x[..., d // 2 : d].copy()
    x[..., : d // 2] = a * c - b * s
    x[..., d // 2 : d] = b * c + a * s


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
                m = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
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


def choose_victim(scores: np.ndarray, n_blocks: int, block_size: int, sink_tokens: int, recent_tokens: int,
                  before: int | None = None) -> int | None:
    """The block to evict under retention: among the full blocks after the sinks and before the
    recent window (and before block `before` when given), the one whose tokens drew the least attention on
    average; None if none qualifies.

    `scores` [n_blocks * block_size] holds each held position's mean attention received so far.
    """
    first = blocks_for(sink_tokens, block_size)
    last = n_blocks - 1 - blocks_for(recent_tokens, block_size)     # the last block is never full-and-old
    if before is not None:
        last = min(last, before - 1)
    if last < first:
        return None
    per_block = scores[: n_blocks * block_size].reshape(n_blocks, block_size)[first : last + 1].mean(axis=1)
    return first + int(np.argmin(per_block))


class LayerKV:
    """One layer's view of a sequence: where attention writes its keys and reads them back."""

    def __init__(self, seq: "KVCache", j: int):
        self.seq, self.j = seq, j
        # sparse attention: (first position, rows, selected keys [T, K], counts [T]) of the latest pass, which
        # the layers sharing this layer's indexer reuse in the same pass
        self.selected: tuple[int, int, np.ndarray, np.ndarray] | None = None

    def write(self, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store rows k [T, Hkv, D], v [T, Hkv, Dv] (or latent [T, R], rotary key [T, dr]) at positions start.."""
        self._store(start, (("k", k), ("v", v)))

    def write_index(self, start: int, keys: np.ndarray) -> None:
        """Store the sparse-attention indexer's keys [T, Di] at positions start.. (a latent layer with an indexer)."""
        self._store(start, (("ik", keys),))

    def _store(self, start: int, parts: tuple[tuple[str, np.ndarray], ...]) -> None:
        """Store each (array name, rows [T, ...]) at positions start.., block by block, encoded as the pool keeps them."""
        seq, arrays, bs = self.seq, self.seq.pool.layers[self.j], self.seq.pool.block_size
        table = seq.table
        latent = seq.pool.latent[self.j]
        t = 0
        n = parts[0][1].shape[0]
        while t < n:
            s = start + t
            b, o = table[s // bs], s % bs
            m = min(bs - o, n - t)
            for name, part in parts:
                x = part[t : t + m]
                store, scales = arrays[name], arrays[name + "s"]
                if latent:
                    rows, scale = _encode(x, store.dtype)                       # [m, R], [m]
                    store[b, o : o + m] = rows
                    scales[b, o : o + m] = scale
                else:
                    rows, scale = _encode(x.transpose(1, 0, 2), store.dtype)    # [Hkv, m, D], [Hkv, m]
                    store[b, :, o : o + m] = rows
                    scales[b, :, o : o + m] = scale
            t += m

    def attend(self, q: np.ndarray, positions: np.ndarray, scale: float, window: int | None,
               sinks: np.ndarray | None = None) -> np.ndarray:
        """Attention of q [T, H, D] over this sequence's keys up to each query's position -> [T, H, Dv]
        (`sinks` [H]: per-head logits in each softmax's denominator, gpt-oss)."""
        a, seq = self.seq.pool.layers[self.j], self.seq
        res = attend_paged(q, a["k"], a["ks"], a["v"], a["vs"], seq.table_array(), positions, scale, window, seq.tracking,
                           sinks)
        if seq.tracking:
            res, weights = res
            seq.observe(weights)
        return res

    def index_scores(self, q: np.ndarray, w: np.ndarray, positions: np.ndarray, scale: float) -> np.ndarray:
        """The indexer's scores [T, S] of this sequence's keys for queries q [T, Hi, Di] with head weights w [T, Hi]."""
        a = self.seq.pool.layers[self.j]
        return index_scores(q, w, a["ik"], a["iks"], self.seq.table_array(), positions, scale)

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of positions start .. stop - 1 as float32 [Hkv, stop - start, D] (what attention the
        paged kernel does not run reads; rows written this step included)."""
        a, bs = self.seq.pool.layers[self.j], self.seq.pool.block_size
        blocks = self.seq.table[start // bs : blocks_for(stop, bs)]
        first = start // bs * bs
        out = []
        for name in ("k", "v"):
            store, scales = a[name][blocks], a[name + "s"][blocks]           # [nb, Hkv, B, D], [nb, Hkv, B]
            rows = store.view(np.float16) if store.dtype == np.uint16 else store
            x = rows.astype(np.float32) * scales[..., None]
            x = x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])   # [Hkv, nb * B, D]
            out.append(np.ascontiguousarray(x[:, start - first : stop - first]))
        return out[0], out[1]

    def attend_latent(self, q_nope: np.ndarray, q_rot: np.ndarray, w_uk: np.ndarray, w_uv: np.ndarray,
                      positions: np.ndarray, scale: float,
                      selected: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Latent attention of q [T, H, dn + dr] over this sequence's latents -> [T, H, dv]; with `selected`
        (keys [T, K], counts [T]) over those keys only (sparse attention)."""
        a, seq = self.seq.pool.layers[self.j], self.seq
        if selected is not None:
            res = attend_selected(q_nope, q_rot, w_uk, w_uv, a["k"], a["ks"], a["v"], a["vs"], seq.table_array(),
                                  selected[0], selected[1], int(positions.max()) + 1, scale, seq.tracking)
        else:
            res = attend_latent(q_nope, q_rot, w_uk, w_uv, a["k"], a["ks"], a["v"], a["vs"], seq.table_array(),
                                positions, scale, seq.tracking)
        if seq.tracking:
            res, weights = res
            seq.observe(weights)
        return res


class LayerState:
    """One recurrent layer's view of a sequence: its state after the held tokens (zeros before any).

    A step asks `wanted(T)` after which of its T tokens to hand back the state, reads `state()` and hands
    `write` those states; they become the held ones at `commit`, so a step that fails, or is prepared
    again, runs again from the same state. After a step of at most KEEP_STEP tokens the state after each of
    them is kept: `truncate` may go back into that step. A long step also hands back the states at the
    block boundaries the sequence checkpoints (`KVCache.checkpoint_boundaries`), which it offers the pool
    (`engine.recurrent`); `restore` takes a state over from a checkpoint or a saved session.
    """

    def __init__(self, seq: "KVCache", spec: GatedDeltaNetSpec):
        self.seq, self.shapes = seq, spec.state_shapes
        self.held: dict[int, State] = {}            # sequence length -> the state after that many tokens
        self.pending: tuple[list[State], list[int] | None] | None = None   # the step's states, after how many tokens
        self.marks: dict[int, State] = {}           # the last long step's block-boundary states, for checkpoints

    def state(self) -> State:
        """The state after the sequence's held tokens (fresh zeros at the start)."""
        held = self.held.get(self.seq.length)
        if held is not None:
            return held
        assert self.seq.length == 0, "a recurrent state is missing for the held tokens"
        return tuple(np.zeros(shape, np.float32) for shape in self.shapes)

    def wanted(self, t: int) -> list[int]:
        """After how many of the next step's t tokens the state is wanted, increasing: every one of a short
        step; else the last, and the block boundaries the sequence checkpoints in the step
        (`KVCache.checkpoint_boundaries`)."""
        if t <= KEEP_STEP:
            return list(range(1, t + 1))
        base = self.seq.length
        return [b - base for b in self.seq.checkpoint_boundaries(t) if b < base + t] + [t]

    def write(self, states: list[State], after: Sequence[int] | None = None) -> None:
        """The states after the step's tokens: after the counts `after` (as `wanted` gave them); without it one
        per token, or only the last one's."""
        self.pending = (states, list(after) if after is not None else None)

    def can_return(self, n: int) -> bool:
        """Whether the state after n tokens is at hand (0, the held length, or a token of the last short step)."""
        return n == 0 or n == self.seq.length or n in self.held

    def commit(self, base: int, n: int) -> None:
        """The step of n tokens after `base` is done: its states become the held ones (all of a short step, the
        last of a long one); a block-boundary state of a long step is kept in `marks` for a checkpoint."""
        assert self.pending is not None, "a recurrent layer did not run in the step"
        states, after = self.pending
        self.pending = None
        if after is None:
            assert len(states) in (1, n), "a recurrent layer handed back states for other tokens"
            after = list(range(n - len(states) + 1, n + 1))
        assert len(after) == len(states) and after[-1] == n, "a recurrent layer did not hand back its last state"
        kept = {base + c: st for c, st in zip(after, states)}
        if n <= KEEP_STEP:
            self.held, self.marks = kept, {}
        else:
            self.held = {base + n: states[-1]}
            self.marks = {p: st for p, st in kept.items() if p != base + n}

    def at(self, n: int) -> State | None:
        """The state after n tokens if the last step left it (held, or a block-boundary mark), else None."""
        held = self.held.get(n)
        return held if held is not None else self.marks.get(n)

    def truncate(self, n: int) -> None:
        """Keep only the state after n tokens (`can_return(n)` must hold)."""
        kept = self.held.get(n)
        self.held = {n: own(kept)} if kept is not None else {}
        self.pending, self.marks = None, {}

    def restore(self, n: int, state: State) -> None:
        """Hold `state` as the state after n tokens (the sequence's length once it is restored), and only it."""
        if tuple(tuple(a.shape) for a in state) != tuple(tuple(s) for s in self.shapes):
            raise GenerationError(f"a recurrent state of shapes {[a.shape for a in state]} does not fit a layer "
                                  f"of shapes {list(self.shapes)}")
        self.held, self.pending, self.marks = {n: tuple(state)}, None, {}

    @property
    def nbytes(self) -> int:
        """Bytes of the states held (a block-boundary mark is the pool's once it is checkpointed)."""
        return sum(a.nbytes for st in self.held.values() for a in st)


def _encode(x: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray | np.float32]:
    """Rows of x [..., D] as stored: float32 or fp16 bits (uint16) with scale 1, or int8 with scale absmax / 127
    per row."""
    if dtype == np.float32:
        return x, np.float32(1.0)
    if dtype == np.uint16:
        return x.astype(np.float16).view(np.uint16), np.float32(1.0)
    amax = np.abs(x).max(axis=-1)
    scale = (amax / np.float32(127.0)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    return np.clip(np.rint(x / safe[..., None]), -127, 127).astype(np.int8), scale


class KVCache:
    """The KV cache of one sequence: a block table into a pool, the tokens it holds, its length.

    Without a pool it makes its own, private, sized for `max_len` (every caller that needs one cache).
    The interface the model uses: `prepare(ids)` (positions of the next tokens, blocks allocated),
    per-layer `write` + `attend` through `layers[j]`, `commit(T)`; `truncate(n)` forgets the tail.

    For each window group of the pool (sliding-window layers of one window), the first `_front[g]` blocks of
    the table are ones this sequence no longer attends to in those layers (counted out of the pool's `need`);
    every later block's rows are kept. The front moves on as `prepare` starts each step, never past what the
    step's first position needs, so a step can be rolled back (`truncate`) to its start exactly.
    """

    def __init__(self, spec: ModelSpec, max_len: int | None = None, *, pool: KVPool | None = None,
                 overflow: str = "error", sink_tokens: int = SINK_TOKENS, recent_tokens: int | None = None):
        self.max_len = int(max_len or spec.max_position)
        if pool is None:
            pool = KVPool(spec, blocks_for(self.max_len) + 1, prefix_cache=False)
        check_kv_settings(pool.block_size, pool.bits, overflow)
        if spec.is_recurrent and overflow != "error":
            raise ColibriError(f"overflow {overflow!r} is not available for {spec.architecture}: its recurrent layers "
                               "cannot forget evicted tokens; use overflow 'error' and a larger --ctx")
        self.pool, self.spec, self.overflow = pool, spec, overflow
        self.sink_tokens = sink_tokens
        self.recent_tokens = recent_tokens if recent_tokens is not None else self.max_len // 4
        self.table: list[int] = []
        self.tokens: list[int] = []
        self.length = 0
        self._table_np: np.ndarray | None = None
        self._digests: list[bytes] = []         # prefix hash of each full block still matching its prefix
        self.layers: list[LayerKV | LayerState] = [
            LayerState(self, layer.attn) if isinstance(layer.attn, GatedDeltaNetSpec) else LayerKV(self, j)
            for j, layer in enumerate(spec.layers)]
        self.states = [layer for layer in self.layers if isinstance(layer, LayerState)]
        self.tracking = overflow == "retain"
        self.heat = np.zeros(0, np.float64)     # attention received per position (retention)
        self.born = np.zeros(0, np.int64)       # the step each position was written at
        self.steps = 0
        self.evicted = 0                        # positions evicted past the context limit
        self._front = [0] * len(pool.windows)   # per window group: leading blocks no longer attended to
        self._diverged: int | None = None       # recurrent: where the prompt left the cached prefix blocks
        self._prompt_end: int | None = None     # recurrent: the adopted prompt's length (what follows is generated)
        self._rolling: bytes | None = None      # recurrent: this sequence's checkpoint in its generated tokens

    # --- the model's interface ---

    def positions(self, n: int) -> np.ndarray:
        """Positions of the next n tokens (the token ids are not recorded: use `prepare` when they are known)."""
        return self.prepare([-1] * n)

    def prepare(self, ids: Sequence[int]) -> np.ndarray:
        """Room for the next tokens (blocks allocated, overflow handled); their positions."""
        n = len(ids)
        if self.length + n > self.max_len:
            self._overflow(n)
        bs = self.pool.block_size
        last = self.length // bs
        if self.length % bs and self._shared(last):   # writing into a shared block: copy it first
            self._privatize(last)
        counted = len(self.table)
        while len(self.table) * bs < self.length + n:
            self.table.append(self.pool.allocate())
            self._table_np = None
        self._settle(counted, [self._frontier(g, self.length) for g in range(len(self._front))])
        del self.tokens[self.length :]
        self.tokens.extend(int(t) for t in ids)
        for state in self.states:             # a step prepared again runs again from the held state
            state.pending = None
        if self.tracking:
            self._grow_scores(self.length + n)
            self.born[self.length : self.length + n] = self.steps
        return np.arange(self.length, self.length + n, dtype=np.int64)

    def commit(self, n: int) -> None:
        """Mark n more positions as filled (after every layer wrote them); index blocks that became full.

        A recurrent sequence's blocks are indexed too, and the recurrent layers' states at block boundaries the
        step crossed are offered to the pool as checkpoints (`_checkpoint`): another sequence adopts its blocks
        only up to a boundary with one."""
        base = self.length
        for state in self.states:
            state.commit(self.length, n)
        self.length += n
        self.steps += n
        bs = self.pool.block_size
        while len(self._digests) < self.length // bs:
            i = len(self._digests)
            parent = self._digests[-1] if self._digests else ROOT
            block = self.tokens[i * bs : (i + 1) * bs]
            fresh = parent and not self.evicted and min(block) >= 0   # contents a fresh run would compute
            digest = prefix_digest(parent, block) if fresh else b""
            self._digests.append(digest)
            if digest:
                self.pool.publish(self.table[i], digest)
        if self.states:
            self._checkpoint(base)

    def checkpoint_boundaries(self, t: int) -> list[int]:
        """The block boundaries a step of t more tokens crosses where the recurrent layers' states are to be
        checkpointed, increasing: the last one, and where this sequence's prompt stopped matching the cached
        prefix blocks (`adopt`: the next prompt sharing that prefix resumes there); none when the pool keeps
        no checkpoints."""
        if self.pool.checkpoints is None or self.evicted or not self.pool.checkpoints.useful:
            return []
        bs, end = self.pool.block_size, self.length + t
        wanted = {end // bs * bs}
        if self._diverged is not None:
            wanted.add(self._diverged)
        return sorted(b for b in wanted if self.length < b <= end)

    def _checkpoint(self, base: int) -> None:
        """Offer the pool the recurrent states at the block boundaries the step after `base` (just committed)
        crossed and left states at: those `checkpoint_boundaries` asked for, or every one of a short step.

        Past the end of an adopted prompt only the latest is kept (each replaces the one before): the next turn
        of a conversation resumes from the end of this one, and decoding would otherwise push a snapshot out of
        the pool every block."""
        checkpoints, bs = self.pool.checkpoints, self.pool.block_size
        if checkpoints is None:
            return
        crossed = range((base // bs + 1) * bs, min(self.length, len(self._digests) * bs) + 1, bs)
        for boundary in crossed:
            digest = self._digests[boundary // bs - 1]
            states = [state.at(boundary) for state in self.states]
            if digest and all(st is not None for st in states):
                kept = checkpoints.put(digest, [st for st in states if st is not None])
                if kept and self._prompt_end is not None and boundary > self._prompt_end:
                    if self._rolling is not None and self._rolling != digest:
                        checkpoints.drop(self._rolling)
                    self._rolling = digest
        for state in self.states:
            state.marks = {}

    def table_array(self) -> np.ndarray:
        """The block table as an int32 array (cached until the table changes)."""
        if self._table_np is None:
            self._table_np = np.asarray(self.table, np.int32)
        return self._table_np

    def truncate(self, n: int) -> int:
        """Forget every position from n on; blocks past it go back to the pool. Returns the length kept: n, or
        less where a sliding-window layer has dropped rows position n would attend to (never within the last
        step: rolling a step back to its start is always exact).

        A recurrent sequence goes back to 0, or into its last step when it was short (`can_truncate`); further
        back it cannot and raises GenerationError."""
        n = max(0, min(self.length, int(n)))
        if not self.can_truncate(n):
            raise GenerationError(f"{self.spec.architecture} keeps a recurrent state that cannot go back from "
                                  f"{self.length} to {n} tokens; run the sequence again from its start")
        n = self._intact(n)
        for state in self.states:
            state.truncate(n)
        counted = self._cut(n, len(self.table))
        self._settle(counted, [min(f, self._frontier(g, n)) for g, f in enumerate(self._front)])
        return n

    def _cut(self, n: int, counted: int) -> int:
        """Forget positions from n on; table entries from `counted` on are not counted in the pool's `need`.
        Returns where the counted entries end now."""
        bs, pool = self.pool.block_size, self.pool
        keep = blocks_for(n, bs)
        for k in range(keep, len(self.table)):
            for g, front in enumerate(self._front):
                if front <= k < counted:
                    self._unneed(g, k, leaving=True)
            pool.release(self.table[k])
        if len(self.table) > keep:
            del self.table[keep:]
            self._table_np = None
        self._front = [min(f, keep) for f in self._front]
        self.length = n
        del self.tokens[n:]
        del self._digests[n // bs :]
        return min(counted, keep)

    # --- sliding-window layers: rows no longer attended to are dropped ---

    def _frontier(self, g: int, pos: int) -> int:
        """Blocks wholly before the window of a query at `pos` in window group g."""
        return max(0, pos - self.pool.windows[g] + 1) // self.pool.block_size

    def _intact(self, n: int) -> int:
        """The largest length <= n whose next query finds every row its windows need."""
        bs, pool = self.pool.block_size, self.pool
        while pool.windows:
            bad = -1
            for g, w in enumerate(pool.windows):
                for k in range(max(0, n - w + 1) // bs, blocks_for(n, bs)):
                    if pool.dropped[g, self.table[k]]:
                        bad = max(bad, k)
            if bad < 0:
                break
            n = bad * bs
        return n

    def _unneed(self, g: int, k: int, leaving: bool = False) -> None:
        """This sequence no longer attends to table entry k in group g; its rows go when no holder does (kept
        when this sequence is leaving a block no one else holds: it stays cached for a prefix to reuse)."""
        pool, b = self.pool, self.table[k]
        pool.need[g, b] -= 1
        if pool.need[g, b] == 0 and not pool.dropped[g, b] and (not leaving or pool.ref[b] > 1):
            pool.drop(g, b)

    def _settle(self, counted: int, fronts: list[int]) -> None:
        """Move each group's front to fronts[g]: entries [front, counted) are counted in `need` now, entries
        from `counted` on (just appended or adopted) are not; afterwards exactly [fronts[g], table end) are."""
        pool, n = self.pool, len(self.table)
        for g, f in enumerate(fronts):
            front = self._front[g]
            for k in range(front, min(counted, f)):
                self._unneed(g, k)
            for k in list(range(f, min(front, n))) + list(range(max(f, counted, front), n)):
                b = self.table[k]
                if pool.dropped[g, b]:
                    raise ColibriError(f"KV cache: block {b} of a sliding-window layer was dropped while position "
                                       f"{self.length} still attends to it (an engine bug; please report it)")
                pool.need[g, b] += 1
            for k in range(counted, min(f, n)):          # taken over, never attended to: nothing needs them here
                b = self.table[k]
                if pool.need[g, b] == 0 and not pool.dropped[g, b]:
                    pool.drop(g, b)
            self._front[g] = f

    def can_truncate(self, n: int) -> bool:
        """Whether `truncate(n)` can keep the first n tokens (always, without recurrent layers)."""
        return all(state.can_return(n) for state in self.states)

    def release(self) -> None:
        """Give every block back (the sequence ended or was cancelled); the cache is empty afterwards."""
        self.truncate(0)

    close = release

    def adopt(self, prompt: Sequence[int]) -> int:
        """Reuse what is already computed for a prompt: the tokens this sequence holds in common with it,
        then full blocks of the prompt found in the pool's prefix index. Returns how many of the
        prompt's tokens are held (always fewer than all, so the last one runs and gives logits).

        With recurrent layers the blocks are taken only up to the longest boundary with a state checkpoint,
        whose states are restored; where the blocks matched further, the prompt's run checkpoints the states
        at the end of the match, so the next prompt sharing that prefix takes all of it."""
        prompt = list(prompt)
        limit = len(prompt) - 1
        same = 0
        self._diverged, self._prompt_end, self._rolling = None, len(prompt), None
        for a, b in zip(self.tokens[: min(self.length, limit)], prompt):
            if a != b:
                break
            same += 1
        # a recurrent state can only go on from where it is (or a short step back): else from a checkpoint, or afresh
        self.truncate(same if self.can_truncate(same) else 0)
        bs = self.pool.block_size
        if not self.pool.prefix_cache or self.length % bs or self.evicted or (self.states and
                                                                              self.pool.checkpoints is None):
            return self.length
        counted = len(self.table)
        start = self.length
        marks = [start]                    # lengths at which the recurrent states are at hand
        checkpoints = self.pool.checkpoints
        while self.length + bs <= limit:
            parent = self._digests[-1] if self._digests else ROOT
            digest = prefix_digest(parent, prompt[self.length : self.length + bs])
            block = self.pool.lookup(digest)
            if block is None:
                break
            self.pool.retain(block)
            self.table.append(block)
            self._table_np = None
            self.tokens.extend(prompt[self.length : self.length + bs])
            self._digests.append(digest)
            self.length += bs
            if self.tracking:
                self._grow_scores(self.length)
            if self.states and checkpoints is not None and checkpoints.has(digest):
                marks.append(self.length)
        # a prefix whose windows' rows are dropped (its holder moved on) is held only up to where they are whole,
        # and with recurrent layers only up to the last boundary whose states were checkpointed
        matched = self.length
        target = self._intact(self.length)
        states = None
        if self.states and checkpoints is not None:
            target = max((m for m in marks if m <= target), default=0)
            states = checkpoints.get(self._digests[target // bs - 1]) if target > start else None
        counted = self._cut(target, counted)
        for state, st in zip(self.states, states or ()):
            state.restore(target, st)
        # the blocks matched further than the states: checkpoint where they stop matching, for the next prompt
        self._diverged = matched if self.states and matched > target else None
        self._settle(counted, [self._frontier(g, self.length) for g in range(len(self._front))])
        return self.length

    # --- saved sessions (engine.generation.session) ---

    @property
    def digests(self) -> tuple[bytes, ...]:
        """Each full block's prefix hash (b"" for a block that no longer matches a fresh run)."""
        return tuple(self._digests)

    def restore(self, table: list[int], tokens: list[int], length: int, digests: list[bytes], heat: np.ndarray,
                born: np.ndarray, steps: int, evicted: int, states: Sequence[State] = ()) -> None:
        """Take over blocks filled from a saved session (already allocated in this pool, into a cache that held
        none): the table, tokens and length, the prefix hashes (republished, so prefix reuse finds them), the
        retention state and, for recurrent layers, their `states` after the held tokens (one per layer, in
        order). Sliding-window layers' rows the next query does not attend to are dropped."""
        if len(states) != len(self.states) and int(length):
            raise GenerationError(f"{self.spec.architecture} has {len(self.states)} recurrent layers but "
                                  f"{len(states)} states were given to restore")
        for state, st in zip(self.states, states):
            state.restore(int(length), st)
        self.table, self.tokens, self.length = list(table), list(tokens), int(length)
        self._digests, self._table_np = list(digests), None
        for b, digest in zip(self.table, self._digests):
            if digest:
                self.pool.publish(b, digest)
        self.heat, self.born = np.array(heat, np.float64), np.array(born, np.int64)
        self.steps, self.evicted = int(steps), int(evicted)
        self._front = [0] * len(self._front)      # the blocks were filled outside `prepare`: none is counted yet
        self._settle(0, [self._frontier(g, self.length) for g in range(len(self._front))])

    # --- retention past max_len ---

    def observe(self, weights: np.ndarray) -> None:
        """Add attention weights [rows, S] (one layer's queries) to the positions' heavy-hitter scores."""
        self.heat[: weights.shape[1]] += weights.sum(axis=0, dtype=np.float64)

    def _grow_scores(self, n: int) -> None:
        if self.heat.size < n:
            size = max(n, 2 * self.heat.size, 64)
            self.heat = np.concatenate([self.heat, np.zeros(size - self.heat.size)])
            self.born = np.concatenate([self.born, np.zeros(size - self.born.size, np.int64)])

    def mean_attention(self) -> np.ndarray:
        """Each held position's attention received per step it has been visible (retention's score)."""
        n = self.length
        age = np.maximum(self.steps - self.born[:n], 1)
        return self.heat[:n] / age

    def _overflow(self, n: int) -> None:
        bs = self.pool.block_size
        if self.overflow == "error" or n > self.max_len - bs:
            raise GenerationError(
                f"the sequence would reach {self.length + n} tokens but the context holds {self.max_len}; "
                "use a shorter prompt, fewer --max-tokens, a larger --ctx, or --overflow retain|slide")
        while self.length + n > self.max_len:
            full = self.length // bs
            if self.overflow == "slide":
                victim = 0 if full else None
            else:
                before = self._evictable()
                victim = choose_victim(self.mean_attention(), full, bs, self.sink_tokens, self.recent_tokens,
                                       before) if full else None
                if victim is None and full:
                    victim = min(blocks_for(self.sink_tokens, bs), full - 1)
                    if before is not None and victim >= before:
                        victim = 0
            if victim is None:
                raise GenerationError(f"the context of {self.max_len} tokens has no full block left to evict; "
                                      "raise --ctx")
            self._evict(victim)

    def _evictable(self) -> int | None:
        """Evicting a block moves the later ones a block down, so a sliding layer's window then reaches a block
        further back. Where the window already starts at its front (the block before is dropped), only blocks
        before the front may go; the bound over the window groups, or None."""
        fronts = [f for g, f in enumerate(self._front) if f and f == self._frontier(g, self.length)]
        return min(fronts, default=None)

    def _evict(self, i: int) -> None:
        """Drop block i of the table; later positions move down one block (keys rotated back)."""
        bs, pool = self.pool.block_size, self.pool
        for k in range(i + 1, len(self.table)):
            if self._shared(k):
                self._privatize(k)
            pool.unpublish(self.table[k])
            b = self.table[k]
            for j, arrays in enumerate(pool.layers):
                rope = pool.rope[j]
                if rope is None or (pool.group[j] >= 0 and pool.dropped[pool.group[j], b]):
                    continue                                   # a recurrent layer, or rows dropped: nothing to rotate
                rotated = ("v", "ik") if pool.latent[j] else ("k",)   # rotary keys (and the indexer's, whose
                for name in (n for n in rotated if n in arrays):       # first rope.dim features rotate)
                    key, scale = arrays[name], arrays[name + "s"]
                    stored = key[b].view(np.float16) if key.dtype == np.uint16 else key[b]
                    rows = stored.astype(np.float32) * scale[b][..., None]
                    _rotate_back(rows, rope, -bs)
                    stored, s = _encode(rows, key.dtype)
                    key[b] = stored
                    scale[b] = s
        for g, front in enumerate(self._front):
            if i < front:
                self._front[g] = front - 1
            else:
                self._unneed(g, i, leaving=True)
        pool.release(self.table.pop(i))
        self._table_np = None
        lo, hi = i * bs, (i + 1) * bs
        del self.tokens[lo:hi]
        del self._digests[i:]
        if self.tracking:
            n = self.heat.size
            self.heat = np.concatenate([self.heat[:lo], self.heat[hi:], np.zeros(bs)])[:n]
            self.born = np.concatenate([self.born[:lo], self.born[hi:], np.zeros(bs, np.int64)])[:n]
        self.length -= bs
        self.evicted += bs

    def _shared(self, i: int) -> bool:
        b = self.table[i]
        return self.pool.ref[b] > 1 or self.pool.hashes[b] is not None

    def _privatize(self, i: int) -> None:
        b = self.table[i]
        if self.pool.ref[b] > 1:
            passed = [g for g, front in enumerate(self._front) if i < front]   # rows not needed in the copy
            dst = self.pool.copy(b, passed)
            for g in range(len(self._front)):
                if g not in passed:
                    self._unneed(g, i, leaving=True)
                    self.pool.need[g, dst] += 1
            self.table[i] = dst
            self.pool.release(b)
            self._table_np = None
        else:
            self.pool.unpublish(b)

    # --- figures ---

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this sequence holds (less the rows its sliding-window layers dropped), and of its
        recurrent states."""
        pool, table = self.pool, self.table_array()
        dropped = sum(int(np.count_nonzero(pool.dropped[g, table])) * n for g, n in enumerate(pool.group_bytes))
        return len(table) * pool.block_bytes - dropped + sum(state.nbytes for state in self.states)
