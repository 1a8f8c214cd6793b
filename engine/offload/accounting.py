"""The expert store's accounting: the hits of each tier, the replacement policy's clock and what it is told of every
use, the experts pinned from the usage history (and re-pinned as the workload moves), and the recent layer steps
that teach the policy its half-life and that the cache-quality meter replays (engine/offload/quality.py).
"""

from __future__ import annotations

from collections import deque
from typing import AbstractSet, Collection, Iterable

import numpy as np

from engine.offload.history import Repinner, UsageHistory
from engine.offload.policy import (
    DEFAULT_HALF_LIFE_TOKENS,
    Policy,
    ValuingPolicy,
    make_policy,
    tune_half_life,
    wants_admission,
)
from engine.offload.quality import CacheTrace
from engine.offload.readahead import ReadAhead
from engine.offload.store_types import Key, StoreSettings
from engine.offload.story import TIER_CACHED, TIER_PINNED
from engine.spec import ModelSpec, MoESpec
from engine.telemetry import Telemetry

LEARN_STEPS = 4096          # recent layer steps learn_policy replays (about six half-lives at the longest choice)
MIN_LEARN_TOKENS = 32       # fewer tokens than this teach nothing about the half-life


class Accounting:
    """Tier hits, the policy and its clock, pins, and the record of layer steps, of a store of `n_slots` slots."""

    def __init__(self, spec: ModelSpec, settings: StoreSettings, n_slots: int, history: UsageHistory | None,
                 read_ahead: ReadAhead, telemetry: Telemetry):
        self.history, self.read_ahead, self.telemetry = history, read_ahead, telemetry
        self.log = read_ahead.log                      # each expert's counters (engine/offload/story.py)
        self.policy_name = settings.policy
        self.n_layers = spec.n_layers
        tokens = history.policy_half_life if history is not None and history.policy_half_life else None
        self.half_life_tokens = tokens or DEFAULT_HALF_LIFE_TOKENS   # learned by an earlier session (learn_policy)
        half_life = self.half_life_tokens * spec.n_layers   # the policies count layer steps
        per_token = sum(layer.ffn.top_k for layer in spec.layers if isinstance(layer.ffn, MoESpec))
        self.per_token = per_token
        self.n_experts = sum(layer.ffn.n_experts for layer in spec.layers if isinstance(layer.ffn, MoESpec))
        self.admission = wants_admission(n_slots, per_token) if settings.policy != "lru" else False
        if settings.policy == "learned" and history is not None:
            self.policy: Policy = make_policy("learned", history.counts, half_life=half_life, admission=self.admission)
        else:                                            # "learned" without a history yet starts as LFRU
            name = "lfru" if settings.policy == "learned" else settings.policy
            self.policy = make_policy(name, half_life=half_life, admission=self.admission)
        # the policy's value of a key, when it has one (frequency policies): admission and read-ahead ask it
        self.valuing: ValuingPolicy | None = self.policy if isinstance(self.policy, ValuingPolicy) else None
        self.now = 0                                   # layer steps so far (the policies' clock)
        self.pinned: set[Key] = set()
        self.missed: set[Key] = set()                  # asked for by `need` and counted: `account` skips them
        self.hits = {"pinned": 0, "cached": 0, "disk": 0}
        self.repinner = Repinner(max(0, int(n_slots * settings.pin_fraction)), every_tokens=settings.repin_every)
        self.tokens = 0
        self.trace: list[tuple[int, tuple[int, ...]]] | None = None   # set to a list to record every layer step
        self.recent: deque[tuple[int, tuple[int, ...]]] = deque(maxlen=LEARN_STEPS)   # what learn_policy replays
        # (layer steps, memory hits, requests) counted at each token's end: the live hits over whole tokens of `recent`
        self.marks: deque[tuple[int, int, int]] = deque([(0, 0, 0)], maxlen=LEARN_STEPS)
        self.prior = history.counts if history is not None else None   # the learned policy's prior at start

    # --- the policy ---

    def insert(self, key: Key) -> None:
        """`key` is in memory to stay."""
        self.policy.insert(key, self.now)

    def access(self, key: Key) -> None:
        """A use of `key` now."""
        self.policy.access(key, self.now)

    def reused(self, key: Key) -> None:
        """A use of `key`, in memory and counted already (`needed`): an access for the policy unless pinned."""
        if key not in self.pinned:
            self.policy.access(key, self.now)

    def taken_in(self, key: Key) -> None:
        """`key` is in memory and used by its step: the policy keeps it unless it is pinned."""
        if key not in self.pinned:
            self.policy.insert(key, self.now)
            self.policy.access(key, self.now)

    def remove(self, key: Key) -> None:
        """`key` leaves memory."""
        self.policy.remove(key)

    def victim(self, exclude: AbstractSet[Key]) -> Key | None:
        """The cached key the policy gives up first outside `exclude`, None when there is none."""
        try:
            return self.policy.victim(exclude)
        except LookupError:
            return None

    # --- hits ---

    def held(self, key: Key) -> None:
        """Count a step's use of an expert in memory: a hit of its tier, an access for the policy, a prefetch used."""
        self.hit(key)
        self.read_ahead.used(key)

    def hit(self, key: Key) -> None:
        """A hit of `key`'s tier, and an access for the policy."""
        tier = "pinned" if key in self.pinned else "cached"
        self.hits[tier] += 1
        self.log.hits[key] += 1
        self.telemetry.hit(tier)
        if key not in self.pinned:
            self.policy.access(key, self.now)

    def disk(self, key: Key) -> None:
        """A step's use of an expert not in memory: a miss read from disk (a prefetch used if it was read ahead)."""
        self.hits["disk"] += 1
        self.log.misses[key] += 1
        self.log.routes.read(self.tokens, key)
        self.telemetry.hit("disk")
        self.read_ahead.used(key)

    def needed(self, key: Key) -> None:
        """A running fused call needs `key`, not in memory: counted as a miss once a token (`account` skips it)."""
        if key not in self.missed:                       # (asked again in one token: counted once)
            self.missed.add(key)
            self.disk(key)

    def take_missed(self, key: Key) -> bool:
        """Whether `key` was counted by `needed` this token (its step counts it no more)."""
        counted = key in self.missed
        self.missed.discard(key)
        return counted

    def forget_missed(self) -> None:
        """A token is not given after all: its misses are counted again when asked again."""
        self.missed.clear()

    def begin_step(self, layer: int, ids: list[int], record: bool = True) -> None:
        """A layer step begins: the policy's clock, the prediction's score, the recent steps and trace, and the usage
        history (unless `record` is False: the caller records its steps together)."""
        self.now += 1
        self.log.steps[layer] += 1
        self.log.chose(layer, ids)
        self.log.routes.begin(self.tokens, layer, ids, self.missed)   # (a fused call's misses are counted before)
        self.read_ahead.score_step(layer, ids)
        step = (layer, tuple(ids))
        self.recent.append(step)
        if self.trace is not None:
            self.trace.append(step)
        if record and self.history is not None:
            self.history.record(layer, np.asarray(ids))

    def account_steps(self, steps: list[tuple[int, list[int]]], built: Collection[Key]) -> None:
        """Count layer steps whose experts were all in memory (`built`) when computed, in order: the policy's
        accesses once a step, the hits and the history's counts once for all."""
        missed, pinned, read_ahead = self.missed, self.pinned, self.read_ahead
        held = {"pinned": 0, "cached": 0}
        served: list[Key] = []                          # each expert's hits, counted together
        for layer, ids in steps:
            self.begin_step(layer, ids, record=False)
            used = []                                    # the policy's accesses, in the order `hit` makes them
            for i in ids:
                key = (layer, i)
                if key in missed:
                    missed.discard(key)
                    if key in built and key not in pinned:
                        used.append(key)
                    continue
                served.append(key)
                if key in pinned:                        # (what `held` does, its counters summed)
                    held["pinned"] += 1
                else:
                    held["cached"] += 1
                    used.append(key)
                read_ahead.used(key)
            self.policy.access_many(used, self.now)
        self.log.hit_many(served)
        for tier, n in held.items():
            if n:
                self.hits[tier] += n
                self.telemetry.hit(tier, n)
        if self.history is not None and steps:
            self.history.record_steps([layer for layer, _ in steps], [ids for _, ids in steps])

    # --- pins ---

    def pin(self, keys: Iterable[Key], known: Collection[Key], built: Collection[Key]) -> None:
        """Pin those of `keys` that are experts (`known`) while there is room: resident ones leave the policy's
        reach (the store reads the others)."""
        for key in keys:
            if key not in known or len(self.pinned) >= self.repinner.capacity:
                continue
            self.pinned.add(key)
            if key in built:
                self.policy.remove(key)
                self.log.tier(key, TIER_PINNED)

    def unpin(self, key: Key) -> None:
        """`key` is no longer pinned (the caller tells the policy whether it stays)."""
        self.pinned.discard(key)

    def end_token(self, n: int, built: Collection[Key]) -> frozenset[Key]:
        """Advance the usage history by n tokens; the keys to pin now that the workload has moved (those to unpin
        are unpinned, back in the policy's reach)."""
        self.tokens += n
        self.log.tokens = self.tokens
        self.missed.clear()
        hits = self.hits
        held = hits["pinned"] + hits["cached"]
        self.marks.append((self.now, held, held + hits["disk"]))
        if self.history is None:
            return frozenset()
        self.history.end_token(n)
        if self.repinner.capacity <= 0:
            return frozenset()
        to_pin, to_unpin = self.repinner.update(self.history, frozenset(self.pinned), self.tokens)
        for key in to_unpin:
            self.pinned.discard(key)
            if key in built:
                self.policy.insert(key, self.now)
                self.log.tier(key, TIER_CACHED)
        return to_pin

    def resize(self, n_slots: int, settings: StoreSettings) -> None:
        """The store now has `n_slots` slots: so many may be pinned."""
        self.repinner = Repinner(int(n_slots * settings.pin_fraction), every_tokens=settings.repin_every)

    def cache_trace(self, n_slots: int, slot_bytes: int, pin_fraction: float) -> CacheTrace:
        """The recent layer steps of whole tokens, with what the policy needs to replay them and the live hits over
        them (a token's misses may be counted before its steps begin: only ended tokens count)."""
        first = self.now - len(self.recent)                # steps before the ring's oldest
        start = next((m for m in self.marks if m[0] >= first), self.marks[-1])
        end = self.marks[-1]
        steps = tuple(self.recent)[start[0] - first: end[0] - first]
        learned = self.policy.name == "learned"
        return CacheTrace(steps, n_slots, slot_bytes, self.n_experts, self.policy.name,
                          self.half_life_tokens * self.n_layers, self.per_token, pin_fraction,
                          self.prior if learned else None,
                          self.history.counts if self.history is not None and self.repinner.capacity > 0 else None,
                          end[1] - start[1], end[2] - start[2])

    def learn_policy(self, n_slots: int) -> float | None:
        """Replay the recent layer steps at each candidate half-life (with the prior and pins the session started
        from) and keep the best in the usage history; it in tokens (None without a history, a learned policy, or
        enough steps to judge)."""
        if (self.history is None or self.policy_name != "learned" or self.prior is None
                or len(self.recent) < MIN_LEARN_TOKENS * self.n_layers):
            return None
        pins = self.history.pinned(self.repinner.capacity) if self.repinner.capacity else frozenset()
        tokens = tune_half_life(list(self.recent), n_slots, self.n_layers, self.prior, pins, self.admission)
        self.history.policy_half_life = tokens
        return tokens
