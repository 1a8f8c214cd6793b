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

The bookkeeping runs on one thread at a time: the engine thread, or, while a fused decode call
runs, that call's driver (engine/fused/plan.py), which asks for what the call lacks (`need`),
reads ahead, and takes no slot from an expert the call may be reading (`guard`). Listeners
hear of every expert that starts being read, arrives, or leaves (before its slot is read over).
"""

from __future__ import annotations

import concurrent.futures as cf
import mmap
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import AbstractSet, Callable, Iterator, Mapping, Sequence

import numpy as np

from engine.blocks.ffn import ExpertWeights
from engine.errors import ColibriError, ModelFormatError
from engine.formats.container import Container
from engine.pages import advise_huge_pages
from engine.spec import ModelSpec, MoESpec
from engine.offload.history import Repinner, UsageHistory
from engine.offload.io import PAGE, IOPool, round_up
from engine.offload.mapped import MappedExperts
from engine.offload.policy import DEFAULT_HALF_LIFE_TOKENS, make_policy, tune_half_life, wants_admission
from engine.offload.reads import SlotReads
from engine.offload.store_types import Key, PrefetchStats, Recipe, StoreSettings, StoreStats, expert_names
from engine.telemetry import NULL, Telemetry

READING = "reading"         # what listeners hear when a read of an expert starts (it follows once in memory)
LEARN_STEPS = 4096          # recent layer steps learn_policy replays (6 half-lives: 0.8 s at close, measured)
MIN_LEARN_TOKENS = 32       # fewer tokens than this teach nothing about the half-life
# A guess the store refuses (its expert is worth less than the one it would push out) is read through a scratch slot
# instead when it is among the first THROUGH_RANKS of its guess and that rank's absent guesses were used by their
# step at least THROUGH_PRECISION of the time lately (an average over about THROUGH_MEMORY of them). At 10% of
# mixtral-1.7b's experts the first ranks' absent guesses were used 77%, 65%, 55% and 42% of the time, at 25% 20-30%:
# a wasted read costs the disk's time, the bound where much is missed.
THROUGH_RANKS = 4
THROUGH_PRECISION = 0.5
THROUGH_MEMORY = 64


class ExpertStore(SlotReads, MappedExperts):
    """Routed experts of a container in a byte budget (an `ExpertSource` for the MoE blocks); its reads into slots
    are in engine/offload/reads.py, its `--io mmap` mode in engine/offload/mapped.py."""

    def __init__(self, container: Container, spec: ModelSpec, settings: StoreSettings,
                 history: UsageHistory | None = None, telemetry: Telemetry = NULL):
        settings.check()
        self.container, self.spec, self.settings, self.telemetry = container, spec, settings, telemetry
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
        self.slot_bytes = round_up(max(r.length for r in self.recipes.values()), PAGE)
        self.n_slots = settings.capacity // self.slot_bytes
        min_slots = max(layer.ffn.top_k for layer in spec.layers if isinstance(layer.ffn, MoESpec))
        if self.n_slots < min_slots:
            raise ColibriError(f"an expert cache of {settings.capacity} bytes holds {self.n_slots} experts of "
                               f"{self.slot_bytes} bytes; a token needs {min_slots} at once: allow at least "
                               f"{min_slots * self.slot_bytes} bytes for experts (raise --max-memory)")
        self.history = history
        tokens = history.policy_half_life if history is not None and history.policy_half_life else None
        self.half_life_tokens = tokens or DEFAULT_HALF_LIFE_TOKENS   # learned by an earlier session (learn_policy)
        half_life = self.half_life_tokens * spec.n_layers   # the policies count layer steps
        per_token = sum(layer.ffn.top_k for layer in spec.layers if isinstance(layer.ffn, MoESpec))
        admission = wants_admission(self.n_slots, per_token) if settings.policy != "lru" else False
        self.admission = admission
        self.n_layers = spec.n_layers
        if settings.policy == "learned" and history is not None:
            self.policy = make_policy("learned", history.counts, half_life=half_life, admission=admission)
        else:                                            # "learned" without a history yet starts as LFRU
            name = "lfru" if settings.policy == "learned" else settings.policy
            self.policy = make_policy(name, half_life=half_life, admission=admission)
        self.now = 0                                   # layer steps so far (the policies' clock)
        self.where: dict[Key, int] = {}                # resident or loading key -> slot
        self.loading: dict[Key, cf.Future] = {}        # reads in flight
        self.built: dict[Key, ExpertWeights] = {}      # resident experts
        self.pinned: set[Key] = set()
        self.prefetched: set[Key] = set()              # read ahead and not yet used
        self.verified: set[Key] = set()
        self.checks: dict[Key, cf.Future] = {}         # experts in memory whose checksum is still to be confirmed
        self.free: list[int] = []
        self.hits = {"pinned": 0, "cached": 0, "disk": 0}
        self.bytes_read = self.reads = 0
        self.pf_issued = self.pf_used = self.pf_wasted = 0
        self.predicted: dict[int, set[int]] = {}       # layer -> experts predicted for its next step
        self.pf_counts = [0, 0, 0]                     # predicted, needed, correct
        self.absent_guessed: dict[int, list[tuple[int, int]]] = {}   # layer -> (rank, expert) guessed, not in memory
        self.rank_precision = [0.0] * THROUGH_RANKS    # how often each rank's absent guesses were used (see above)
        self.repinner = Repinner(max(0, int(self.n_slots * settings.pin_fraction)), every_tokens=settings.repin_every)
        self.tokens = 0
        self.trace: list[tuple[int, tuple[int, ...]]] | None = None   # set to a list to record every layer step
        self.recent: deque[tuple[int, tuple[int, ...]]] = deque(maxlen=LEARN_STEPS)   # what learn_policy replays
        self.prior = history.counts if history is not None else None   # the learned policy's prior at start
        if settings.io == "mmap":
            self.arena = None
            self.io = None
            self.maps = {str(Path(container.path) / f): m for f, m in container.maps.items()}
        else:
            # room for every expert, reserved but not committed: the budget may grow later without moving
            # experts, and only the budget's slots take memory (committed at load; a shrink hands pages back)
            self.max_slots = len(self.recipes)
            self._arena_map = mmap.mmap(-1, self.max_slots * self.slot_bytes,
                                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
            advise_huge_pages(self._arena_map)     # the kernels read slots as they read resident weights
            self.arena = np.frombuffer(self._arena_map, np.uint8)
            self.n_slots = min(self.n_slots, self.max_slots)
            self.io = IOPool(settings.io_threads, settings.direct)
            self.free = list(range(self.n_slots - 1, -1, -1))
            self._commit(0, self.n_slots)
        self.views: dict[tuple[int, tuple], tuple] = {}   # (slot, layout) -> an expert's tensors over the slot
        self.stepping: set[Key] = set()                # the experts of the layer step in progress, not yet computed
        self.listeners: list[Callable[[Key, ExpertWeights | None], None]] = []   # see add_listener
        self.on_read: Callable[[], None] | None = None   # called on a reader thread as a read completes (see _read)
        # called on a reader thread with an expert as its read completes, before the store takes it in: a running
        # fused call waiting for it goes on without the driver waking (see _read)
        self.on_arrival: Callable[[Key, ExpertWeights], None] | None = None
        self.on_close: list[Callable[[], None]] = []   # called by close
        # while a fused call runs (its driver holds the store): whether an expert may give up its slot now (False:
        # the call may be reading it; see engine/fused/plan.py)
        self.guard: Callable[[Key], bool] | None = None
        self.missed: set[Key] = set()                  # asked for by `need` and counted: `account` skips them
        self.scratch: list[int] = []                   # slots for experts read through, not kept (admission)
        self.transient: set[Key] = set()
        self._layout_scratch()
        if history is not None and history.tokens > 0 and self.repinner.capacity > 0:
            self._pin(history.pinned(self.repinner.capacity))

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
        self._begin_step(layer, ids)
        if self.settings.io == "mmap":
            if started is not None:
                started()
            yield self._mmap_step(layer, ids)
            self._trim_mapped()                          # the step's experts are computed: back within capacity
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
        tel = self.telemetry
        for key in step:
            counted = key in self.missed                 # a fused call asked for it (`need`) and stopped
            self.missed.discard(key)
            if key in self.built:
                if not counted:
                    self._count_held(key)
                elif key not in self.pinned:
                    self.policy.access(key, self.now)
                ready[key[1]] = self.built[key]
                continue
            if not counted:
                self.hits["disk"] += 1
                tel.hit("disk")
                self._count_prefetch_use(key)
            if key in self.loading:                      # read ahead, still in flight
                waiting[self.loading[key]] = key
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
                    if not self.loading:
                        raise ColibriError(f"the expert cache ({self.n_slots} slots, {len(self.pinned)} pinned) cannot "
                                           "hold this step's experts; raise --max-memory")
                    with tel.phase("io_wait"):
                        cf.wait(list(self.loading.values()), return_when=cf.FIRST_COMPLETED)
                    continue
            with tel.phase("io_wait"):
                done, _ = cf.wait(list(waiting), return_when=cf.FIRST_COMPLETED)
            group: dict[int, ExpertWeights] = {}
            for fut in done:
                key = waiting.pop(fut)
                self._finish(key, fut)
                group[key[1]] = self.built[key]
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
        """`account` for several layer steps, in order: one call for a fused token's streamed layers. (At 25% of
        mixtral-1.7b's experts, with the usage history on, sixteen calls of `account` took 0.47-0.56 ms a token on
        the engine thread between two tokens, this 0.31-0.36 ms: the policy's increment once a step, the hits and
        the history's counts once a token.)"""
        steps = [(int(layer), [int(i) for i in ids]) for layer, ids in steps]
        if self.loading:
            self._settle()                               # reads handed over to the call as they completed
        if self.checks:                                  # (the steps ran them: their answer is not given if one fails)
            self._confirm([(layer, i) for layer, ids in steps for i in ids])
        missed, built, pinned, prefetched = self.missed, self.built, self.pinned, self.prefetched
        held = {"pinned": 0, "cached": 0}
        for layer, ids in steps:
            self._begin_step(layer, ids, record=False)
            used = []                                    # the policy's accesses, in the order `account` made them
            for i in ids:
                key = (layer, i)
                if key in missed:
                    missed.discard(key)
                    if key in built and key not in pinned:
                        used.append(key)
                    continue
                if key in pinned:                        # (what _count_held does, its counters summed)
                    held["pinned"] += 1
                else:
                    held["cached"] += 1
                    used.append(key)
                if key in prefetched:
                    self._count_prefetch_use(key)
            self.policy.access_many(used, self.now)
        for tier, n in held.items():
            if n:
                self.hits[tier] += n
                self.telemetry.hit(tier, n)
        if self.history is not None and steps:
            self.history.record_steps([layer for layer, _ in steps], [ids for _, ids in steps])

    def need(self, layer: int, ids: Sequence[int], meanwhile: Callable[[], None] = lambda: None) -> bool:
        """Start reading the experts of a layer step that are not in memory (a fused call waits for them, see
        `add_listener`), the last of them on this thread (it returns once that one is in; `meanwhile()` is called
        once, before that read or at the end); False when some cannot have a slot now (the call stops and `groups`
        brings them)."""
        step = [(layer, int(i)) for i in ids]
        queue = []
        for key in step:
            if key in self.built:
                continue
            if key not in self.missed:                   # (asked again in one token: counted once)
                self.hits["disk"] += 1
                self.telemetry.hit("disk")
                self.missed.add(key)
                self._count_prefetch_use(key)
            if key not in self.loading:
                queue.append(key)
        self._start(queue, set(step), {}, here=meanwhile)   # (the caller, the driver, would only wait for them)
        return not queue

    def _count_held(self, key: Key) -> None:
        """Count a step's use of an expert in memory: a hit of its tier, an access for the policy, a prefetch used."""
        tier = "pinned" if key in self.pinned else "cached"
        self.hits[tier] += 1
        self.telemetry.hit(tier)
        if key not in self.pinned:
            self.policy.access(key, self.now)
        self._count_prefetch_use(key)

    def _count_prefetch_use(self, key: Key) -> None:
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.pf_used += 1
            self.telemetry.prefetch(used=1)

    def _begin_step(self, layer: int, ids: list[int], record: bool = True) -> None:
        """A layer step begins: the policy's clock, the prediction's score, the recent steps and trace, and the usage
        history (unless `record` is False: the caller records its steps together)."""
        self.now += 1
        self._score_prediction(layer, ids)
        step = (layer, tuple(ids))
        self.recent.append(step)
        if self.trace is not None:
            self.trace.append(step)
        if record and self.history is not None:
            self.history.record(layer, np.asarray(ids))

    def add_listener(self, fn: Callable[[Key, ExpertWeights | None], None]) -> bool:
        """Call fn(key, expert) whenever an expert is in memory to stay (until the next call for its key), and
        fn(key, None) when it leaves, before its memory is read over; called at once for those in memory now.
        pread mode only (mapped experts never count as in memory): False in mmap mode."""
        if self.settings.io == "mmap":
            return False
        self.listeners.append(fn)
        for key, e in self.built.items():
            if key not in self.transient:
                fn(key, e)
        return True

    def _notify(self, key: Key, e: ExpertWeights | None) -> None:
        for fn in self.listeners:
            fn(key, e)

    # --- lookahead ---

    def prefetch(self, layer: int, ids: Sequence[int], read: bool = True) -> None:
        """Start reading the experts predicted for `layer`'s next step (no waiting); with read=False only note the
        prediction (it is scored, as every prediction, when the step comes)."""
        ids = [int(i) for i in ids]
        self.predicted[layer] = set(ids)
        absent = [(r, i) for r, i in enumerate(ids[:THROUGH_RANKS]) if (layer, i) not in self.where]
        self.absent_guessed[layer] = absent
        if self.settings.io == "mmap" or not read:
            return
        queue = [(layer, i) for i in ids if (layer, i) not in self.where]
        protect = {(layer, i) for i in ids}
        through = {(layer, i) for r, i in absent if self.rank_precision[r] >= THROUGH_PRECISION}
        before = len(self.loading)
        self._start(queue, protect, {}, prefetch=True, through=through)
        started = len(self.loading) - before
        if started:
            self.pf_issued += started
            self.telemetry.prefetch(issued=started)

    def _score_prediction(self, layer: int, ids: list[int]) -> None:
        predicted = self.predicted.pop(layer, None)
        if predicted is None:
            return
        needed = set(ids)
        precision = self.rank_precision
        for r, i in self.absent_guessed.pop(layer, ()):
            precision[r] += ((i in needed) - precision[r]) / THROUGH_MEMORY
        self.pf_counts[0] += len(predicted)
        self.pf_counts[1] += len(needed)
        self.pf_counts[2] += len(predicted & needed)

    # --- per token ---

    def end_token(self, n: int = 1) -> None:
        """Advance the usage history by n tokens and re-pin when the workload has moved."""
        self.tokens += n
        self.missed.clear()
        self._publish()
        if self.history is None:
            return
        self.history.end_token(n)
        if self.repinner.capacity > 0:
            to_pin, to_unpin = self.repinner.update(self.history, frozenset(self.pinned), self.tokens)
            for key in to_unpin:
                self.pinned.discard(key)
                if key in self.built:
                    self.policy.insert(key, self.now)
            if to_pin:
                self._pin(to_pin)

    def set_capacity(self, capacity: int) -> None:
        """Change the byte budget between tokens: shrinking evicts (and returns the memory), growing lets the cache fill."""
        slots = capacity // self.slot_bytes
        min_slots = max(layer.ffn.top_k for layer in self.spec.layers if isinstance(layer.ffn, MoESpec))
        if slots < min_slots:
            raise ColibriError(f"an expert cache of {capacity} bytes holds {slots} experts; a token needs {min_slots}: "
                               f"allow at least {min_slots * self.slot_bytes} bytes for experts")
        self.settings = replace(self.settings, capacity=capacity)
        if self.settings.io == "mmap":
            self.n_slots = slots
            self._trim_mapped()
            self.repinner = Repinner(int(slots * self.settings.pin_fraction), every_tokens=self.settings.repin_every)
            return
        slots = min(slots, self.max_slots)
        for fut in list(self.loading.values()):          # reads in flight finish first: their slots may go
            cf.wait([fut])
        self._settle()
        self._reclaim(set())
        if slots < self.n_slots:
            for key in [k for k, slot in self.where.items() if slot >= slots]:
                if key in self.pinned:
                    self.pinned.discard(key)
                    self.policy.insert(key, self.now)
                self._evict(key)
            self.free = [f for f in self.free if f < slots]
            self._arena_map.madvise(mmap.MADV_DONTNEED, slots * self.slot_bytes, (self.n_slots - slots) * self.slot_bytes)
            excess = len(self.pinned) - int(slots * self.settings.pin_fraction)
            for key in sorted(self.pinned)[:max(excess, 0)]:
                self.pinned.discard(key)
                self.policy.insert(key, self.now)
        else:
            self._commit(self.n_slots, slots)
            self.free.extend(range(slots - 1, self.n_slots - 1, -1))
        self.n_slots = slots
        self.free.extend(f for f in self.scratch if f < slots)   # re-laid below
        self.scratch = []
        self._layout_scratch()
        self.repinner = Repinner(int(slots * self.settings.pin_fraction), every_tokens=self.settings.repin_every)
        self._publish()

    def set_io_threads(self, threads: int) -> None:
        """Change the number of reader threads between tokens (reads in flight finish on the old pool)."""
        if threads == self.settings.io_threads:
            return
        self.settings = replace(self.settings, io_threads=threads)
        self.settings.check()
        if self.io is not None:
            old, self.io = self.io, IOPool(threads, self.settings.direct)
            for fut in list(self.loading.values()):
                cf.wait([fut])
            old.close()

    def stats(self) -> StoreStats:
        """Counters and occupancy now."""
        return StoreStats(dict(self.hits), self.bytes_read, self.reads, self.pf_issued, self.pf_used, self.pf_wasted,
                          PrefetchStats(*self.pf_counts), self._occupancy(), self.n_slots, self.slot_bytes)

    def learn_policy(self) -> float | None:
        """Replay this session's recent layer steps at each candidate half-life (with the prior and pins it
        started from) and keep the best in the usage history for the next start; returns it in tokens
        (None without a history, a learned policy, or enough steps to judge)."""
        if (self.history is None or self.settings.policy != "learned" or self.prior is None
                or len(self.recent) < MIN_LEARN_TOKENS * self.n_layers):
            return None
        pins = self.history.pinned(self.repinner.capacity) if self.repinner.capacity else frozenset()
        tokens = tune_half_life(list(self.recent), self.n_slots, self.n_layers, self.prior, pins, self.admission)
        self.history.policy_half_life = tokens
        return tokens

    def close(self) -> None:
        """Stop the readers (waiting for reads in flight) and drop the arena."""
        for fn in self.on_close:
            fn()
        self.on_close = []
        if self.io is not None:
            for fut in list(self.loading.values()):
                try:
                    fut.result()
                except Exception:  # noqa: BLE001 - closing: a failed read no longer matters
                    pass
            self.io.close()
            self.io = None
        self.loading.clear()
        self.checks.clear()
        self.built.clear()
        self.views.clear()
        self.where.clear()
        self.arena = None

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals ---

    def _pin(self, keys) -> None:
        """Pin keys: resident ones move out of the policy's reach, the others are read in the background."""
        for key in keys:
            if key not in self.recipes or len(self.pinned) >= self.repinner.capacity:
                continue
            self.pinned.add(key)
            if key in self.built:
                self.policy.remove(key)
        if self.settings.io != "mmap":
            queue = [k for k in keys if k in self.pinned and k not in self.where]
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
            dest = self.arena[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]
            self.where[key] = slot
            self._notify(key, READING)                   # (before the read: it may be handed over as it completes)
            inline = here is not None and not queue
            if inline:
                here()
            fut = self._read(key, r, dest, inline)
            self.loading[key] = fut
            if prefetch:
                self.prefetched.add(key)
            else:
                waiting[fut] = key
            self.bytes_read += r.length
            self.reads += 1
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
        if self.free:
            return self.free.pop()
        self._settle()
        if self.free:
            return self.free.pop()
        exclude = protect | self.stepping | self.loading.keys() | self.pinned
        while True:
            try:
                victim = self.policy.victim(exclude)
            except LookupError:
                victim = None
            admit = getattr(self.policy, "admit", None)
            through = key is not None and key not in self.pinned and (
                victim is None or (admit is not None and not admit(key, victim)))
            score = getattr(self.policy, "score", None)
            if prefetch and (through or victim is not None and score is not None and score(key) <= score(victim)):
                # a guess never pushes out an expert worth more than it (measured: it halved decode), nor is it read
                # through a scratch slot (measured: every guess so read filled the disk's time), but at the ranks
                # whose guesses are mostly used, `read_through`
                through = read_through and key not in self.pinned
                if not through:
                    return None
            if through:
                if not self.scratch:
                    self._reclaim(protect)
                if self.scratch:
                    self.transient.add(key)   # read through a scratch slot: used by its step, then taken back
                    return self.scratch.pop()
                if prefetch:
                    return None
            if victim is None:
                return None
            if self.guard is None or self.guard(victim):
                return self._take(victim)
            exclude.add(victim)       # a running call may be reading it: choose again without it

    def _reclaim(self, protect: set[Key]) -> None:
        """Scratch slots back from experts read through them whose step went by (a fused call ran them without
        asking `groups`), never one a running call may be reading (`guard`)."""
        for key in [k for k in self.transient if k in self.built and k not in protect and k not in self.stepping
                    and (self.guard is None or self.guard(k))]:
            self._drop_transient(key)
            if key in self.prefetched:
                self.prefetched.discard(key)
                self.pf_wasted += 1
                self.telemetry.prefetch(wasted=1)

    def _drop_transient(self, key: Key) -> None:
        self.transient.discard(key)
        self.checks.pop(key, None)                      # (read again, it is checked again)
        del self.built[key]
        self._notify(key, None)
        self.scratch.append(self.where.pop(key))

    def _take(self, victim: Key) -> int:
        self._evict(victim)
        return self.free.pop()

    def _release(self, layer: int, group: Mapping[int, ExpertWeights]) -> None:
        """Experts read through (not kept) are done with: their scratch slots return."""
        for i in group:
            key = (layer, i)
            if key in self.transient and key in self.built:
                self._drop_transient(key)

    def _commit(self, lo: int, hi: int) -> None:
        """Fault in the pages of slots lo..hi - 1, not in use, now rather than at their first read mid-token: one
        write a 4 KB page (the kernel zeroes a page at its first write, 2 MB at once where it gives huge ones).
        Measured by `colibri bench` at 25% of mixtral-1.7b's experts, on 2 MB pages: cold prompts at 70-78 tok/s
        with the first reads faulting, 87-108 with the pages committed at load (76-93 on 4 KB pages, faulting)."""
        start, end = lo * self.slot_bytes, hi * self.slot_bytes
        if end > start:
            self.arena[start:end:PAGE] = 0
            self.arena[end - 1] = 0

    def _layout_scratch(self) -> None:
        """Reserve the last slots for read-through when the policy admits by value (a quarter, at most top_k)."""
        if self.settings.io == "mmap" or not getattr(self.policy, "admission", False):
            return
        top_k = max(layer.ffn.top_k for layer in self.spec.layers if isinstance(layer.ffn, MoESpec))
        n = min(top_k, self.n_slots // 4)
        want = set(range(self.n_slots - n, self.n_slots))
        for key in [k for k, slot in self.where.items() if slot in want]:
            self.pinned.discard(key)
            if key in self.built:
                self.policy.insert(key, self.now)
                self._evict(key)
        self.free = [f for f in self.free if f not in want]
        self.scratch = sorted(want, reverse=True)

    def collect(self) -> None:
        """Take in the reads that completed in the background: their experts are in memory (listeners told)."""
        if self.settings.io != "mmap":
            self._settle()

    def _evict(self, key: Key) -> None:
        self.policy.remove(key)
        self.checks.pop(key, None)
        if self.built.pop(key, None) is not None:
            self._notify(key, None)
        self.free.append(self.where.pop(key))
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.pf_wasted += 1
            self.telemetry.prefetch(wasted=1)

    def _occupancy(self) -> dict[str, int]:
        held = sum(map(self._length.__getitem__, self.built))    # (every token: measured 0.2 ms as two generators)
        pinned = sum(self._length[k] for k in self.pinned if k in self.built)
        cached = held - pinned
        disk = self.total_bytes - held
        return {"pinned": pinned, "cached": cached, "disk": disk}

    def _publish(self) -> None:
        tel = self.telemetry
        if tel.enabled:
            for tier, nbytes in self._occupancy().items():
                tel.set_occupancy(tier, nbytes)
