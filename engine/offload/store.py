"""The expert store: routed experts of a container held in a byte budget, read from disk on demand.

Each MoE layer step asks for the distinct experts its tokens chose (the Union). Experts live in
tiers (Place): *pinned* (chosen from the usage history, never evicted), *cached* (replaced by a
policy: LRU, frequency-and-recency, or learned from history) and *disk*. Misses are read by an
I/O pool into fixed-size slots of one aligned arena, one `pread` per expert, while the experts
already in memory compute (Overlap): `groups` yields the resident ones at once and the others as
their reads finish. The next layers' experts are predicted and read ahead (`prefetch`). Routing
counts feed the usage history, which re-pins with hysteresis as the workload changes (Learn).

The store never changes an answer: a slot's bytes are the container's bytes (CRC-32 checked on
the first read, before the step that ran the expert gives its answer), and the MoE block sums the
experts' outputs in a fixed order whatever arrived first. I/O threads only fill slots and check sums.

`--io mmap` is the baseline the others are measured against: experts are views of the mapped
files, read by page faults inside the kernels; evicted ones are dropped with MADV_DONTNEED so
the budget still holds.

`ExpertStore` is a facade over parts, each in its own module: the slot memory (slots.py), the read
queue (reads.py), the read-ahead's guesses and counters (readahead.py), the tier hits, policy and
pins (accounting.py) and the `--io mmap` mode (mapped.py). It decides where an expert goes and
tells the parts.

The bookkeeping runs on one thread at a time: the engine thread, or, while a fused decode call
runs, that call's driver (engine/fused/driver.py), which asks for what the call lacks (`need`),
reads ahead, and takes no slot from an expert the call may be reading (the `guard` of the
`StoreHooks` it attaches). Listeners hear of every expert that starts being read, arrives, or
leaves (before its slot is read over).
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import replace
from typing import AbstractSet, Callable, Iterator, Mapping, Sequence

from engine.blocks.ffn import NO_HOOKS, ExpertWeights, StoreHooks
from engine.errors import ColibriError, ModelFormatError
from engine.formats.container import Container
from engine.offload.accounting import Accounting
from engine.offload.history import UsageHistory
from engine.offload.io import PAGE, IOPool, round_up
from engine.offload.mapped import MappedExperts
from engine.offload.pressure import MemoryGuard
from engine.offload.quality import CacheTrace
from engine.offload.readahead import THROUGH_RANKS, ReadAhead
from engine.offload.reads import ReadQueue
from engine.offload.slots import SlotArena
from engine.offload.store_types import (
    IOCounts,
    Key,
    Recipe,
    StoreSettings,
    StoreStats,
    expert_names,
)
from engine.offload.story import TIER_CACHED, TIER_DISK, TIER_PINNED, ExpertCounts, ExpertLog
from engine.spec import ModelSpec, MoESpec
from engine.telemetry import NULL, Telemetry

# the share of the cache's slots a batch's expected union may fill (`batch_rows`)
UNION_FILL = 0.9
READING = "reading"         # what listeners hear when a read of an expert starts (it follows once in memory)


class ExpertStore:
    """Routed experts of a container in a byte budget (a `StreamingExpertSource` for the MoE blocks)."""

    def __init__(self, container: Container, spec: ModelSpec, settings: StoreSettings,
                 history: UsageHistory | None = None, telemetry: Telemetry = NULL):
        settings.check()
        self.container, self.spec, self.settings, self.telemetry = container, spec, settings, telemetry
        self.history = history
        self.names: dict[Key, tuple[str, str, str]] = {}
        self.recipes: dict[Key, Recipe] = {}
        for i, layer in enumerate(spec.layers):
            if isinstance(layer.ffn, MoESpec):
                for e in range(layer.ffn.n_experts):
                    names = expert_names(i, layer.ffn, e)
                    if (i, e) not in container.extents:
                        raise ModelFormatError(f"{container.path}: expert {e} of layer {i} is not stored as an extent; "
                                               "streaming needs a container written by `colibri convert`")
                    self.names[(i, e)] = names
                    self.recipes[(i, e)] = Recipe(container, i, e, names)
        if not self.recipes:
            raise ColibriError(f"{container.path}: the model has no routed experts to stream")
        self._length = {k: r.length for k, r in self.recipes.items()}   # (summed over what is in memory, a token)
        self.total_bytes = sum(self._length.values())
        slot_bytes = round_up(max(r.length for r in self.recipes.values()), PAGE)
        n_slots = settings.capacity // slot_bytes
        self._top_k = max(layer.ffn.top_k for layer in spec.layers if isinstance(layer.ffn, MoESpec))
        if n_slots < self._top_k:
            raise ColibriError(f"an expert cache of {settings.capacity} bytes holds {n_slots} experts of "
                               f"{slot_bytes} bytes; a token needs {self._top_k} at once: allow at least "
                               f"{self._top_k * slot_bytes} bytes for experts (raise --max-memory)")
        mapped = settings.io == "mmap"
        n_experts = max(layer.ffn.n_experts for layer in spec.layers if isinstance(layer.ffn, MoESpec))
        self.log = ExpertLog(spec.n_layers, n_experts, self._top_k)   # each expert's story (engine/offload/story.py)
        self.read_ahead = ReadAhead(telemetry, self.log)
        self.accounting = Accounting(spec, settings, n_slots, history, self.read_ahead, telemetry)
        self.slots = SlotArena(slot_bytes, n_slots, len(self.recipes), reserve=not mapped)
        self.counts = IOCounts()
        io = None if mapped else IOPool(settings.io_threads, settings.direct)
        self.reads = ReadQueue(io, self.slots, self.names, settings.verify)
        self.mapped = (MappedExperts(container, self.recipes, self.names, self.slots, self.accounting, self.counts,
                                     telemetry) if mapped else None)
        self.stepping: set[Key] = set()                # the experts of the layer step in progress, not yet computed
        self.listeners: list[Callable[[Key, ExpertWeights | None], None]] = []   # see add_listener
        self.hooks: StoreHooks = NO_HOOKS              # a fused call's driver's (see attach)
        self._layout_scratch()
        # gives way to other programs' memory between tokens (None: off)
        self.guard: MemoryGuard | None = MemoryGuard(self, telemetry=telemetry) if settings.pressure else None
        repin = self.accounting.repinner.capacity
        if history is not None and history.tokens > 0 and repin > 0:
            self._pin(history.pinned(repin))

    # --- what the rest of the engine reads ---

    @property
    def built(self) -> Mapping[Key, ExpertWeights]:
        """The experts in memory now."""
        return self.slots.built

    @property
    def pinned(self) -> AbstractSet[Key]:
        """The experts pinned from the usage history."""
        return self.accounting.pinned

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot (the largest expert, rounded up to a page)."""
        return self.slots.slot_bytes

    @property
    def n_slots(self) -> int:
        """Slots in the budget (experts held at once)."""
        return self.slots.n_slots

    @property
    def trace(self) -> list[tuple[int, tuple[int, ...]]] | None:
        """Every layer step since it was set to a list (None: not recorded)."""
        return self.accounting.trace

    @trace.setter
    def trace(self, steps: list[tuple[int, tuple[int, ...]]] | None) -> None:
        self.accounting.trace = steps

    def attach(self, hooks: StoreHooks | None) -> None:
        """Attach a fused call's driver's callbacks, replacing those attached before (None: detach them)."""
        self.hooks = hooks or NO_HOOKS
        self.reads.hooks = self.hooks

    # --- the ExpertSource protocol ---

    def experts(self, layer: int, ids: Sequence[int]) -> Mapping[int, ExpertWeights]:
        """The given experts of one layer, all in memory at once (blocking)."""
        out: dict[int, ExpertWeights] = {}
        for group in self.groups(layer, ids):
            out.update(group)
        return out

    def groups(self, layer: int, ids: Sequence[int],
               started: Callable[[], None] | None = None) -> Iterator[Mapping[int, ExpertWeights]]:
        """The given experts in groups: the resident ones first, then the others as their reads finish.

        An expert yielded stays in memory until the caller asks for the next group (or ends the loop).
        When the cache holds fewer slots than the step needs, later reads wait for earlier groups to be
        consumed and reuse their slots. `started` is called once this step's reads are queued (before any
        waiting): reads the caller starts then (read-ahead) queue behind them.
        """
        ids = [int(i) for i in ids]
        self.accounting.begin_step(layer, ids)
        if self.mapped is not None:
            if started is not None:
                started()
            yield self.mapped.step(layer, ids)
            self.mapped.trim()                           # the step's experts are computed: back within capacity
            return
        step = [(layer, i) for i in ids]
        protect = set(step)
        self.stepping = protect                          # what a read-ahead started meanwhile must not evict
        try:
            yield from self._step_groups(layer, step, protect, started)
        finally:
            self.stepping = set()

    def _step_groups(self, layer: int, step: list[Key], protect: set[Key],
                     started: Callable[[], None] | None) -> Iterator[Mapping[int, ExpertWeights]]:
        ready: dict[int, ExpertWeights] = {}
        waiting: dict[cf.Future, Key] = {}
        queue: list[Key] = []
        tel, acc, built, loading = self.telemetry, self.accounting, self.slots.built, self.reads.loading
        for key in step:
            counted = acc.take_missed(key)               # a fused call asked for it (`need`) and stopped
            if key in built:
                if not counted:
                    acc.held(key)
                else:
                    acc.reused(key)
                ready[key[1]] = built[key]
                continue
            if not counted:
                acc.disk(key)
            if key in loading:                           # read ahead, still in flight
                waiting[loading[key]] = key
            else:
                queue.append(key)
        self._start(queue, protect, waiting)
        if started is not None:
            started()
        if ready:
            self._confirm((layer, i) for i in ready)
            yield ready
            self._release(layer, ready)                  # those read ahead through scratch slots are done with
            protect.difference_update((layer, i) for i in ready)   # computed: their slots may be reused
        while waiting or queue:
            if not waiting:
                # every slot is pinned, read ahead (in flight) or held by this step: make room, else wait for a read
                self._start(queue, protect, waiting)
                if not waiting:
                    if not loading:
                        raise ColibriError(f"the expert cache ({self.n_slots} slots, {len(self.pinned)} pinned) cannot "
                                           "hold this step's experts; raise --max-memory")
                    with tel.phase("io_wait"):
                        cf.wait(list(loading.values()), return_when=cf.FIRST_COMPLETED)
                    continue
            with tel.phase("io_wait"):
                done, _ = cf.wait(list(waiting), return_when=cf.FIRST_COMPLETED)
            group: dict[int, ExpertWeights] = {}
            for fut in done:
                key = waiting.pop(fut)
                self._finish(key, fut)
                group[key[1]] = built[key]
            self._confirm((layer, i) for i in group)
            yield group
            self._release(layer, group)
            if queue:                                    # slots ran short: consumed experts may now make room
                protect.difference_update((layer, i) for i in group)
                self._start(queue, protect, waiting)

    def account(self, layer: int, ids: Sequence[int]) -> None:
        """Count a layer step whose experts were all in memory when computed, without asking for them through
        `groups` (the fused decode step checks residency itself, see `add_listener`, and asks for the others with
        `need`): what `groups` counts for such a step."""
        self.account_steps([(layer, ids)])

    def account_steps(self, steps: Sequence[tuple[int, Sequence[int]]]) -> None:
        """`account` for several layer steps, in order: one call for a fused token's streamed layers (the policy's
        increment once a step, the hits and the history's counts once a token, off the path between two tokens)."""
        steps = [(int(layer), [int(i) for i in ids]) for layer, ids in steps]
        if self.reads.loading:
            self._settle()                               # reads handed over to the call as they completed
        if self.reads.checks:                            # (the steps ran them: their answer is not given if one fails)
            self._confirm([(layer, i) for layer, ids in steps for i in ids])
        self.accounting.account_steps(steps, self.slots.built)

    def need(self, layer: int, ids: Sequence[int], meanwhile: Callable[[], None] = lambda: None) -> bool:
        """Start reading the experts of a layer step that are not in memory (a fused call waits for them, see
        `add_listener`), the last of them on this thread (it returns once that one is in; `meanwhile()` is called
        once, before that read or at the end); False when some cannot have a slot now (the call stops and `groups`
        brings them)."""
        step = [(layer, int(i)) for i in ids]
        acc, built, loading = self.accounting, self.slots.built, self.reads.loading
        queue = []
        for key in step:
            if key in built:
                continue
            acc.needed(key)
            if key not in loading:
                queue.append(key)
        self._start(queue, set(step), {}, here=meanwhile)   # (the caller, the driver, would only wait for them)
        return not queue

    def add_listener(self, fn: Callable[[Key, ExpertWeights | None], None]) -> bool:
        """Call fn(key, expert) whenever an expert is in memory to stay (until the next call for its key), and
        fn(key, None) when it leaves, before its memory is read over; called at once for those in memory now.
        pread mode only (mapped experts never count as in memory): False in mmap mode."""
        if self.mapped is not None:
            return False
        self.listeners.append(fn)
        transient = self.slots.transient
        for key, e in self.slots.built.items():
            if key not in transient:
                fn(key, e)
        return True

    def _notify(self, key: Key, e: ExpertWeights | str | None) -> None:
        if e is not READING and key not in self.slots.transient:   # (one read through a scratch slot keeps no tier)
            self.log.tier(key, TIER_DISK if e is None else TIER_PINNED if key in self.accounting.pinned
                          else TIER_CACHED)
        for fn in self.listeners:
            fn(key, e)

    # --- lookahead ---

    def prefetch(self, layer: int, ids: Sequence[int], read: bool = True) -> None:
        """Start reading the experts predicted for `layer`'s next step (no waiting); with read=False only note the
        prediction (it is scored, as every prediction, when the step comes)."""
        ids = [int(i) for i in ids]
        where = self.slots.where
        absent = [(r, i) for r, i in enumerate(ids[:THROUGH_RANKS]) if (layer, i) not in where]
        self.read_ahead.guess(layer, ids, absent)
        if self.mapped is not None or not read:
            return
        queue = [(layer, i) for i in ids if (layer, i) not in where]
        protect = {(layer, i) for i in ids}
        through = self.read_ahead.through(layer, absent)
        loading = self.reads.loading
        before = len(loading)
        self._start(queue, protect, {}, prefetch=True, through=through)
        started = len(loading) - before
        if started:
            self.read_ahead.issued(started)

    # --- per token ---

    def end_token(self, n: int = 1) -> None:
        """Advance the usage history by n tokens, re-pin when the workload has moved, and let the memory guard
        shrink (or regrow) the cache when other programs have taken (or given back) memory."""
        if self.guard is not None:
            self.guard.check()
        self._publish()
        to_pin = self.accounting.end_token(n, self.slots.built)
        if to_pin:
            self._pin(to_pin)

    def batch_rows(self, most: int) -> int:
        """How many sequences may decode together (1 .. most): the most whose step's experts the cache is expected
        to hold, with room to spare. B rows that each choose k of a layer's E experts, evenly and apart, choose
        E (1 - (1 - k/E)^B) of them; a batch's step reads that union once, but one whose union does not stay in
        the cache reads most of it again at the next step, where the same sequences one after another would find
        their own experts still there."""
        slots = self.settings.capacity // self.slots.slot_bytes * UNION_FILL
        layers = [(m.n_experts, m.top_k) for m in (layer.ffn for layer in self.spec.layers) if isinstance(m, MoESpec)]

        def union(b: int) -> float:
            return sum(e * (1.0 - (1.0 - k / e) ** b) for e, k in layers)
        rows = 1
        while rows < most and union(rows + 1) <= slots:
            rows += 1
        return rows

    @property
    def capacity(self) -> int:
        """Bytes the cache may hold now (pinned + cached)."""
        return self.settings.capacity

    @property
    def min_capacity(self) -> int:
        """The fewest bytes for experts a token can be computed with: top-k slots."""
        return self._top_k * self.slots.slot_bytes

    def set_capacity(self, capacity: int) -> None:
        """Change the byte budget between tokens: shrinking evicts (and returns the memory), growing lets the cache
        fill."""
        arena, acc = self.slots, self.accounting
        slots = capacity // arena.slot_bytes
        if slots < self._top_k:
            raise ColibriError(f"an expert cache of {capacity} bytes holds {slots} experts; a token needs "
                               f"{self._top_k}: allow at least {self._top_k * arena.slot_bytes} bytes for experts")
        self.settings = replace(self.settings, capacity=capacity)
        if self.mapped is not None:
            arena.limit(slots)
            self.mapped.trim()
            acc.resize(slots, self.settings)
            return
        slots = min(slots, arena.max_slots)
        self.reads.wait()                                # reads in flight finish first: their slots may go
        self._settle()
        self._reclaim(set())
        if slots < arena.n_slots:
            for key in [k for k, slot in arena.where.items() if slot >= slots]:
                if key in acc.pinned:
                    acc.unpin(key)
                    acc.insert(key)
                self._evict(key)
            arena.shrink(slots)
            excess = len(acc.pinned) - int(slots * self.settings.pin_fraction)
            for key in sorted(acc.pinned)[:max(excess, 0)]:
                acc.unpin(key)
                acc.insert(key)
        else:
            arena.grow(slots)
        arena.release_scratch()                          # re-laid below
        self._layout_scratch()
        acc.resize(slots, self.settings)
        self._publish()

    def set_io_threads(self, threads: int) -> None:
        """Change the number of reader threads between tokens (reads in flight finish on the old pool)."""
        if threads == self.settings.io_threads:
            return
        self.settings = replace(self.settings, io_threads=threads)
        self.settings.check()
        if self.reads.io is not None:
            self.reads.set_pool(IOPool(threads, self.settings.direct))

    def stats(self) -> StoreStats:
        """Counters and occupancy now."""
        ahead = self.read_ahead.counts
        return StoreStats(dict(self.accounting.hits), self.counts.bytes, self.counts.reads, ahead.issued,
                          ahead.used, ahead.wasted, self.read_ahead.score.frozen(), self._occupancy(), self.n_slots,
                          self.slot_bytes)

    def expert_counts(self) -> ExpertCounts:
        """Each expert's counters and latest tier changes (`engine.offload.story`), copied; engine thread."""
        return self.log.frozen()

    def cache_trace(self) -> CacheTrace:
        """The recent layer steps and what replaying them at other capacities needs (`engine.offload.quality`);
        engine thread (it copies the ring of steps as it stands)."""
        return self.accounting.cache_trace(self.n_slots, self.slot_bytes, self.settings.pin_fraction)

    def learn_policy(self) -> float | None:
        """Replay this session's recent layer steps at each candidate half-life (with the prior and pins it
        started from) and keep the best in the usage history for the next start; returns it in tokens
        (None without a history, a learned policy, or enough steps to judge)."""
        return self.accounting.learn_policy(self.n_slots)

    def collect(self) -> None:
        """Take in the reads that completed in the background: their experts are in memory (listeners told)."""
        if self.mapped is None:
            self._settle()

    def close(self) -> None:
        """Stop the readers (waiting for reads in flight) and drop the arena."""
        on_close = self.hooks.on_close
        self.attach(None)
        if on_close is not None:
            on_close()
        self.reads.close()
        self.slots.close()

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- placement ---

    def _pin(self, keys) -> None:
        """Pin keys: resident ones move out of the policy's reach, the others are read in the background."""
        self.accounting.pin(keys, self.recipes, self.slots.built)
        if self.mapped is None:
            pinned, where = self.accounting.pinned, self.slots.where
            queue = [k for k in keys if k in pinned and k not in where]
            self._start(queue, set(queue), {}, prefetch=False)

    def _start(self, queue: list[Key], protect: set[Key], waiting: dict, prefetch: bool = False,
               here: Callable[[], None] | None = None, through: AbstractSet[Key] = frozenset()) -> None:
        """Start reads for queued keys while slots can be found; leaves the rest queued (in order). With `here`, the
        last key is read on this thread (see IOPool.read_here), after the others went to the reader threads; `here()`
        is called once, before that read (or on return, when none is left for this thread). Guesses in `through`
        may be read through scratch slots (see `_slot`)."""
        inline = False
        while queue:
            key = queue[0]
            slot = self._slot(protect, key, prefetch, key in through)
            if slot is None:
                break
            queue.pop(0)
            r = self.recipes[key]
            dest = self.slots.assign(key, slot)
            self._notify(key, READING)                   # (before the read: it may be handed over as it completes)
            inline = here is not None and not queue
            if inline:
                here()
            fut = self.reads.read(key, r, dest, inline)
            if prefetch:
                self.read_ahead.started(key)
            else:
                waiting[fut] = key
            self.counts.add(r.length)
            self.log.reads[key] += 1
            self.telemetry.bytes_read(r.length)
        if here is not None and not inline:
            here()

    def _slot(self, protect: set[Key], key: Key | None = None, prefetch: bool = False,
              read_through: bool = False) -> int | None:
        """A slot for `key`: a free one, or a cached expert's (never a protected, pinned or loading one).

        With admission (frequency policies), a key worth less than the expert it would push out is read
        through a scratch slot and not kept; a prefetch is then skipped, unless `read_through` (a guess at a
        rank whose absent guesses are mostly used). None when no slot can be had.
        """
        arena, acc = self.slots, self.accounting
        if arena.free:
            return arena.free.pop()
        self._settle()
        if arena.free:
            return arena.free.pop()
        pinned, valuing, guard = acc.pinned, acc.valuing, self.hooks.guard
        exclude = protect | self.stepping | self.reads.loading.keys() | pinned
        while True:
            victim = acc.victim(exclude)
            through = key is not None and key not in pinned and (
                victim is None or (valuing is not None and not valuing.admit(key, victim)))
            if prefetch and (through or victim is not None and valuing is not None
                             and valuing.score(key) <= valuing.score(victim)):
                # a guess never pushes out an expert worth more than it (that slows decode), nor is it read
                # through a scratch slot (such reads fill the disk's time), but at the ranks whose guesses are
                # mostly used, `read_through`
                through = read_through and key not in pinned
                if not through:
                    return None
            if through:
                if not arena.scratch:
                    self._reclaim(protect)
                if arena.scratch:
                    arena.transient.add(key)   # read through a scratch slot: used by its step, then taken back
                    return arena.scratch.pop()
                if prefetch:
                    return None
            if victim is None:
                return None
            if guard is None or guard(victim):
                return self._take(victim)
            exclude.add(victim)       # a running call may be reading it: choose again without it

    def _reclaim(self, protect: set[Key]) -> None:
        """Scratch slots back from experts read through them whose step went by (a fused call ran them without
        asking `groups`), never one a running call may be reading (`guard`)."""
        arena, guard = self.slots, self.hooks.guard
        for key in [k for k in arena.transient if k in arena.built and k not in protect and k not in self.stepping
                    and (guard is None or guard(k))]:
            self._drop_transient(key)
            self.read_ahead.wasted(key)

    def _drop_transient(self, key: Key) -> None:
        self.reads.forget(key)                           # (read again, it is checked again)
        del self.slots.built[key]
        self._notify(key, None)
        self.slots.scratch_slot(key)

    def _take(self, victim: Key) -> int:
        self._evict(victim)
        return self.slots.free.pop()

    def _release(self, layer: int, group: Mapping[int, ExpertWeights]) -> None:
        """Experts read through (not kept) are done with: their scratch slots return."""
        arena = self.slots
        for i in group:
            key = (layer, i)
            if key in arena.transient and key in arena.built:
                self._drop_transient(key)

    def _layout_scratch(self) -> None:
        """Reserve the last slots for read-through when the policy admits by value (a quarter, at most top_k)."""
        valuing = self.accounting.valuing
        if self.mapped is not None or valuing is None or not valuing.admission:
            return
        arena, acc = self.slots, self.accounting
        n = min(self._top_k, arena.n_slots // 4)
        want = set(range(arena.n_slots - n, arena.n_slots))
        for key in arena.keys_in(want):
            acc.unpin(key)
            if key in arena.built:
                acc.insert(key)
                self._evict(key)
        arena.reserve_scratch(want)

    def _evict(self, key: Key) -> None:
        self.accounting.remove(key)
        self.reads.forget(key)
        if self.slots.built.pop(key, None) is not None:
            self._notify(key, None)
        self.slots.free_slot(key)
        self.read_ahead.wasted(key)

    # --- reads in ---

    def _finish(self, key: Key, fut: cf.Future) -> None:
        """A read completed: build the expert over its slot (or free the slot and raise)."""
        arena = self.slots
        if not self.reads.taken(key) and key in arena.built:
            return                                       # already taken in (by _settle)
        try:
            fut.result()
        except BaseException:
            self.reads.forget(key)
            if key in arena.transient:
                arena.scratch_slot(key)
            else:
                arena.free_slot(key)
            self.read_ahead.failed(key)
            self._notify(key, None)
            raise
        e = arena.build(key, self.recipes[key], self.names[key])
        self._notify(key, e)                             # (read through a scratch slot: until it is taken back)
        if key in arena.transient:
            self.accounting.access(key)                  # counted, not kept
            return
        self.accounting.taken_in(key)

    def _settle(self) -> None:
        """Finish reads that completed in the background (prefetches), so their slots are accounted."""
        for key, fut in self.reads.completed():
            try:
                self._finish(key, fut)
            except ColibriError:
                pass                                     # a failed prefetch: the real request reads again and raises

    def _confirm(self, keys) -> None:
        """Raise if an expert of a step just computed (or about to be) was read with a checksum that does not hold;
        it leaves memory first."""
        key = self.reads.failed(keys)
        if key is None:
            return
        if key in self.slots.where:
            self.accounting.unpin(key)
            if key in self.slots.transient:
                self._drop_transient(key)
            else:
                self._evict(key)
        self.accounting.forget_missed()                  # the token is not given: its count starts over
        r = self.recipes[key]
        raise ModelFormatError(f"{r.file}: checksum mismatch in expert {key[1]} of layer {key[0]}; the "
                               "container is corrupt: convert the model again with `colibri convert`")

    # --- telemetry ---

    def _occupancy(self) -> dict[str, int]:
        built = self.slots.built
        held = sum(map(self._length.__getitem__, built))   # (every token: one pass, no generator)
        pinned = sum(self._length[k] for k in self.accounting.pinned if k in built)
        return {"pinned": pinned, "cached": held - pinned, "disk": self.total_bytes - held}

    def _publish(self) -> None:
        tel = self.telemetry
        if tel.enabled:
            for tier, nbytes in self._occupancy().items():
                tel.set_occupancy(tier, nbytes)
