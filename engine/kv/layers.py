"""Each layer's view of a sequence: `LayerKV` writes an attention layer's rows into the sequence's blocks and
attends over them (the paged kernels), `LayerState` holds a recurrent layer's state; `_encode` is how rows are
stored (float32, fp16 bits, or int8 with a scale per row)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from engine.errors import GenerationError
from engine.kernels.attention import attend_latent, attend_paged
from engine.kernels.sparse import attend_selected, index_scores
from engine.kv.pool import blocks_for
from engine.recurrent import State, own
from engine.spec import GatedDeltaNetSpec

if TYPE_CHECKING:
    from engine.kv.cache import KVCache

KEEP_STEP = 16            # a recurrent layer keeps its state after each token of a step this short (drafts roll back)


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
