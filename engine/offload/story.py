"""Each expert's story as the store lives it: requests served from memory and from disk, reads, read-ahead guesses
used and wasted, the last token that chose it, and its tier changes with the token they happened at; and each decoded
token's routing, layer by layer, with the experts it had to wait for from disk (`RouteLog`), for the inspector's replay.

Counters are numpy grids [L, E] and the tier changes one ring of fixed size, so tens of thousands of experts cost a
few arrays, not an object each. The store's parts count into an `ExpertLog` on the engine thread; `frozen` copies it
into `ExpertCounts` for other threads (the inspector), and `ExpertCounts.story` reads one expert's out of that.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from engine.offload.store_types import Key

# Tier codes, as the inspector's grid has them (app.service.messages, ui.inspector.data)
TIER_DISK, TIER_CACHED, TIER_PINNED = 0, 1, 2
CHANGES = 1 << 16                       # tier changes kept (the latest), over all experts
CHANGE = np.dtype([("token", np.int64), ("layer", np.int32), ("expert", np.int32), ("tier", np.int8)])
ROUTE_STEPS = 1 << 16                   # layer steps of decoded tokens kept (the latest)


@dataclass(frozen=True, eq=False)
class Routes:
    """Layer steps of decoded tokens, oldest first: which experts each chose and which came from disk."""

    token: np.ndarray                   # [S] int64 the token's index in the store's count
    layer: np.ndarray                   # [S] int32
    experts: np.ndarray                 # [S, K] int32 chosen experts, -1 past a step's last
    disk: np.ndarray                    # [S, K] bool the step waited for that expert's read

    def tokens(self) -> np.ndarray:
        """The tokens recorded, ascending, each once."""
        return np.unique(self.token)

    def of(self, token: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """One token's steps in layer order: (layer, experts chosen, those read from disk)."""
        out = []
        for i in np.flatnonzero(self.token == token):
            chosen = self.experts[i] >= 0                                  # [K]
            ids, disk = self.experts[i][chosen], self.disk[i][chosen]
            out.append((int(self.layer[i]), tuple(int(e) for e in ids), tuple(int(e) for e in ids[disk])))
        return sorted(out)

    def answers(self) -> list[tuple[int, int]]:
        """Runs of consecutive decoded tokens, (first, last) each: a prompt between two answers leaves a gap."""
        tokens = self.tokens()                                             # [T]
        if not len(tokens):
            return []
        cuts = np.flatnonzero(np.diff(tokens) > 1)                         # last index of each run but the final
        firsts = np.concatenate([[0], cuts + 1])
        lasts = np.concatenate([cuts, [len(tokens) - 1]])
        return [(int(tokens[f]), int(tokens[la])) for f, la in zip(firsts, lasts)]

    def usage(self, first: int, last: int, shape: tuple[int, int]) -> np.ndarray:
        """[L, E] float64: the share of the tokens first..last (those recorded) that chose each expert."""
        rows = (self.token >= first) & (self.token <= last)                # [S]
        grid = np.zeros(shape, np.float64)                                 # [L, E]
        n = len(np.unique(self.token[rows]))
        if not n:
            return grid
        layers = np.repeat(self.layer[rows], self.experts.shape[1])        # [S' * K]
        experts = self.experts[rows].ravel()                               # [S' * K]
        keep = (experts >= 0) & (layers < shape[0]) & (experts < shape[1])
        np.add.at(grid, (layers[keep], experts[keep]), 1.0)
        return grid / n


class RouteLog:
    """The latest layer steps of decoded tokens (at most `top_k` experts each: a prompt's or a batch's wider steps
    are left out), in a ring (engine thread)."""

    def __init__(self, top_k: int, steps: int = ROUTE_STEPS):
        self.token = np.zeros(steps, np.int64)         # [S]
        self.layer = np.zeros(steps, np.int32)         # [S]
        self.experts = np.full((steps, top_k), -1, np.int32)   # [S, K]
        self.disk = np.zeros((steps, top_k), bool)     # [S, K]
        self.written = 0                               # steps recorded in all
        self._open: tuple[int, int, int, list[int]] | None = None   # the last step begun: (row, token, layer, ids)

    def begin(self, token: int, layer: int, ids: list[int], disk: Collection[Key] = ()) -> None:
        """A layer step of token `token` chose `ids`; those of `disk` were read from disk (more may follow, `read`)."""
        k = self.experts.shape[1]
        if len(ids) > k:
            self._open = None
            return
        row = self.written % len(self.token)
        self.written += 1
        self.token[row], self.layer[row] = token, layer
        self.experts[row] = -1
        self.experts[row, :len(ids)] = ids
        self.disk[row] = False
        if disk:
            for j, e in enumerate(ids):
                if (layer, e) in disk:
                    self.disk[row, j] = True
        self._open = (row, token, layer, ids)

    def read(self, token: int, key: Key) -> None:
        """A step of token `token` waits for `key`'s read from disk: marked if it is the last step begun."""
        step = self._open
        if step is not None and step[1] == token and step[2] == key[0] and key[1] in step[3]:
            self.disk[step[0], step[3].index(key[1])] = True

    def frozen(self) -> Routes:
        """A copy, oldest first."""
        n, w = len(self.token), self.written
        order = np.arange(w) if w <= n else (np.arange(n) + w) % n                  # [S'] rows oldest first
        return Routes(self.token[order], self.layer[order], self.experts[order], self.disk[order])


@dataclass(frozen=True)
class ExpertStory:
    """One expert's figures since the store opened."""

    layer: int
    expert: int
    hits: int                           # its steps served from memory (pinned or cached)
    misses: int                         # its steps that waited for it to come from disk
    reads: int                          # reads of it from disk started (a read ahead included)
    ahead_used: int                     # reads ahead of it that a step then used
    ahead_wasted: int                   # reads ahead of it that left memory unused
    share: float                        # its share of its layer's steps (0 before any)
    last: int                           # the last token whose step chose it (-1: none yet)
    changes: tuple[tuple[int, int], ...]   # (token, tier) of its tier changes kept, oldest first

    @property
    def requests(self) -> int:
        """Its layer's steps that chose it."""
        return self.hits + self.misses


@dataclass(frozen=True, eq=False)
class ExpertCounts:
    """A copy of an `ExpertLog`, read-only, for any thread."""

    hits: np.ndarray                    # [L, E] int64
    misses: np.ndarray                  # [L, E] int64
    reads: np.ndarray                   # [L, E] int64
    ahead_used: np.ndarray              # [L, E] int64
    ahead_wasted: np.ndarray            # [L, E] int64
    steps: np.ndarray                   # [L] int64 layer steps of each layer
    last: np.ndarray                    # [L, E] int64 the last token whose step chose each expert, -1 none yet
    changes: np.ndarray                 # [K] CHANGE, oldest first
    tokens: int                         # tokens the store has seen end
    routes: Routes | None = None        # decoded tokens' routing (None: not recorded)

    def story(self, layer: int, expert: int) -> ExpertStory:
        """The story of one expert; IndexError outside the grid."""
        if not (0 <= layer < self.hits.shape[0] and 0 <= expert < self.hits.shape[1]):
            raise IndexError(f"expert {expert} of layer {layer} is outside the {self.hits.shape} grid")
        mine = self.changes[(self.changes["layer"] == layer) & (self.changes["expert"] == expert)]
        steps = int(self.steps[layer])
        requests = int(self.hits[layer, expert] + self.misses[layer, expert])
        return ExpertStory(layer, expert, int(self.hits[layer, expert]), int(self.misses[layer, expert]),
                           int(self.reads[layer, expert]), int(self.ahead_used[layer, expert]),
                           int(self.ahead_wasted[layer, expert]), requests / steps if steps else 0.0,
                           int(self.last[layer, expert]), tuple((int(c["token"]), int(c["tier"])) for c in mine))

    def since_routed(self) -> np.ndarray:
        """[L, E] int64: tokens each expert has gone unchosen since its last step, 0 for the latest token's experts
        (and for the token under way); -1 for experts never chosen."""
        latest = max(self.tokens - 1, 0)                                    # the last token that ended
        return np.where(self.last >= 0, np.maximum(latest - self.last, 0), -1)


class ExpertLog:
    """The counters of every expert of a store, and the latest tier changes (engine thread)."""

    def __init__(self, n_layers: int, n_experts: int, top_k: int, changes: int = CHANGES,
                 route_steps: int = ROUTE_STEPS):
        shape = (n_layers, n_experts)
        self.routes = RouteLog(top_k, route_steps)
        self.hits = np.zeros(shape, np.int64)          # [L, E]
        self.misses = np.zeros(shape, np.int64)        # [L, E]
        self.reads = np.zeros(shape, np.int64)         # [L, E]
        self.ahead_used = np.zeros(shape, np.int64)    # [L, E]
        self.ahead_wasted = np.zeros(shape, np.int64)  # [L, E]
        self.steps = np.zeros(n_layers, np.int64)      # [L]
        self.last = np.full(shape, -1, np.int64)       # [L, E] the last token that chose each, -1 none yet
        self.ring = np.zeros(changes, CHANGE)          # [K] written round
        self.changed = 0                               # tier changes recorded in all
        self.tokens = 0

    def hit_many(self, keys: list[Key]) -> None:
        """Steps served each of `keys` from memory (a key may repeat)."""
        if keys:
            rows, cols = np.array(keys, np.int64).T     # [2, n]
            np.add.at(self.hits, (rows, cols), 1)

    def chose(self, layer: int, ids: list[int]) -> None:
        """A step of layer `layer` in the token under way (`tokens`) chose `ids`."""
        row, token = self.last[layer], self.tokens
        for e in ids:                                  # a few ids: cheaper than fancy indexing
            row[e] = token

    def tier(self, key: Key, tier: int) -> None:
        """`key` moved to `tier` now (TIER_DISK when it left memory)."""
        self.ring[self.changed % len(self.ring)] = (self.tokens, key[0], key[1], tier)
        self.changed += 1

    def frozen(self) -> ExpertCounts:
        """A copy for other threads."""
        n = len(self.ring)
        changes = (self.ring[:self.changed] if self.changed <= n
                   else np.roll(self.ring, -(self.changed % n)))   # oldest first
        return ExpertCounts(self.hits.copy(), self.misses.copy(), self.reads.copy(), self.ahead_used.copy(),
                            self.ahead_wasted.copy(), self.steps.copy(), self.last.copy(), changes.copy(), self.tokens,
                            self.routes.frozen())
