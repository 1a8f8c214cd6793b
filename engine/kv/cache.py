"""`KVCache`: one sequence's KV cache, a block table into a `KVPool` with the tokens it holds.

It allocates blocks as the model prepares a step, publishes full blocks to the prefix index and adopts cached
prefixes (`adopt`), drops the rows its sliding-window layers no longer attend to, retains or slides past
`max_len`, and takes over blocks of a saved session (`restore`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.errors import ColibriError, GenerationError
from engine.kv.layers import LayerKV, LayerState, _encode
from engine.kv.pool import ROOT, KVPool, blocks_for, check_kv_settings, prefix_digest
from engine.kv.retention import SINK_TOKENS, _rotate_back, choose_victim
from engine.recurrent import State
from engine.spec import GatedDeltaNetSpec, ModelSpec


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
