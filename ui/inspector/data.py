"""What the inspector's views draw, as plain frozen data (no Qt): expert tiers, the atlas, one frame.

Tiers are an int8 grid [L, E]: -1 no expert there (a dense layer, or a layer with fewer experts),
0 disk, 1 cached, 2 pinned, 3 resident (a model held whole in memory). `tiers_from_store` reads
them from an `engine.offload.store.ExpertStore`; `resident_tiers` makes them for a resident model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.offload.story import ExpertCounts
from engine.spec import ModelSpec, MoESpec
from engine.telemetry import Snapshot

TIER_NONE, TIER_DISK, TIER_CACHED, TIER_PINNED, TIER_RESIDENT = -1, 0, 1, 2, 3
TIER_UNKNOWN = 4  # the views' own code for "no tiers were given"; never in a tiers array
# (their names, as the views show them: ui.inspector.common.TIER_NAMES)


def _grid_shape(spec: ModelSpec) -> tuple[int, int]:
    """(layers, most experts of any layer) of a spec."""
    experts = [layer.ffn.n_experts for layer in spec.layers if isinstance(layer.ffn, MoESpec)]
    return spec.n_layers, max(experts, default=0)


def resident_tiers(spec: ModelSpec) -> np.ndarray:
    """Tiers [L, E] int8 of a model held whole in memory: every expert resident."""
    tiers = np.full(_grid_shape(spec), TIER_NONE, np.int8)   # [L, E]
    for i, layer in enumerate(spec.layers):
        if isinstance(layer.ffn, MoESpec):
            tiers[i, : layer.ffn.n_experts] = TIER_RESIDENT
    return tiers


def tiers_from_store(store: Any) -> np.ndarray:
    """Tiers [L, E] int8 of an ExpertStore's experts, from its `recipes`, `built` and `pinned`.

    Best called on the engine thread (e.g. in a telemetry subscriber). Elsewhere each attribute is
    copied in one C-level call, which the GIL keeps whole, so a concurrent token can at worst make
    the grid one step stale, never raise.
    """
    every = np.array(tuple(store.recipes), np.int64).reshape(-1, 2)   # [N, 2] (layer, expert)
    built = np.array(tuple(store.built), np.int64).reshape(-1, 2)     # [B, 2]
    pinned = np.array(tuple(store.pinned), np.int64).reshape(-1, 2)   # [P, 2]
    shape = _grid_shape(store.spec)
    tiers = np.full(shape, TIER_NONE, np.int8)                        # [L, E]
    tiers[every[:, 0], every[:, 1]] = TIER_DISK
    tiers[built[:, 0], built[:, 1]] = TIER_CACHED
    tiers[pinned[:, 0], pinned[:, 1]] = TIER_PINNED  # a pinned expert still being read counts as pinned
    return tiers


@dataclass(frozen=True, eq=False)
class AtlasData:
    """An atlas sidecar (`app.atlas.build`) as arrays, one row per expert, positions scaled to the unit ball."""

    keys: np.ndarray             # [N, 2] int64 (layer, expert)
    positions: np.ndarray        # [N, 3] float32, centred, max radius 1
    top: np.ndarray              # [N] int64 index into topics, -1 for an expert never chosen
    specialisation: np.ndarray   # [N] float32 0..1
    selections: np.ndarray       # [N] int64 probe tokens that chose the expert
    topics: tuple[str, ...]      # topic ids ("python")
    titles: tuple[str, ...]      # for people ("Python code")
    index: Mapping[tuple[int, int], int] = field(repr=False)  # (layer, expert) -> row
    distribution: np.ndarray | None = None   # [N, T] float32 each expert's probe selections shared among topics
    explained_variance: tuple[float, ...] = ()  # [3] each position axis's share of the spread, 0..1 (() unknown)

    @classmethod
    def from_dict(cls, atlas: Mapping[str, Any]) -> AtlasData:
        """Arrays of an atlas dict as `app.atlas.build.build_atlas` writes it; ValueError naming what is missing."""
        try:
            topic_rows = atlas["probes"]["topics"]
            topics = tuple(str(t["topic"]) for t in topic_rows)
            titles = tuple(str(t.get("title") or t["topic"]) for t in topic_rows)
            rows = [(int(layer["layer"]), x) for layer in atlas["layers"] for x in layer["experts"]]
            keys = np.array([(layer, int(x["expert"])) for layer, x in rows], np.int64).reshape(-1, 2)
            positions = np.array([x["position"] for _, x in rows], np.float64).reshape(-1, 3)
            names = {t: i for i, t in enumerate(topics)}
            top = np.array([names.get(x["top_topic"], -1) if x["top_topic"] is not None else -1 for _, x in rows],
                           np.int64)
            spec = np.array([float(x["specialisation"]) for _, x in rows], np.float32)
            selections = np.array([int(x["selections"]) for _, x in rows], np.int64)
            distribution = np.array([x.get("topic_distribution") or [0.0] * len(topics) for _, x in rows],
                                    np.float32).reshape(-1, len(topics))
            explained = tuple(float(v) for v in atlas.get("explained_variance") or ())   # absent from older atlases
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a readable Colibri atlas ({type(exc).__name__}: {exc}); "
                             "run `colibri atlas MODEL` again") from None
        if len(positions):
            positions = positions - positions.mean(axis=0)
            radius = float(np.linalg.norm(positions, axis=1).max())
            if radius > 0:
                positions = positions / radius
        index = {(int(layer), int(e)): i for i, (layer, e) in enumerate(keys)}
        return cls(keys, positions.astype(np.float32), top, spec, selections, topics, titles, index, distribution,
                   explained)

    def __len__(self) -> int:
        return len(self.keys)

    def row(self, layer: int, expert: int) -> int | None:
        """The row of (layer, expert), None if the atlas does not know it."""
        return self.index.get((layer, expert))

    def affinities(self, layer: int, expert: int, most: int = 3) -> list[tuple[str, float]]:
        """The expert's `most` strongest topics and their shares of its probe selections (none if unmapped)."""
        i = self.row(layer, expert)
        if i is None or self.distribution is None:
            return []
        shares = self.distribution[i]                                           # [T]
        order = np.argsort(-shares, kind="stable")[:most]
        return [(self.titles[t], float(shares[t])) for t in order if shares[t] > 0]


@dataclass(frozen=True, eq=False)
class Frame:
    """Everything one redraw needs, captured on the GUI thread at a timer tick."""

    snapshot: Snapshot | None
    shape: tuple[int, int]                 # (layers, experts) of the Brain grid
    budget: float | None                   # bytes; set_model_info's, else the "budget" gauge
    tiers: np.ndarray | None               # [L, E] int8
    atlas: AtlasData | None
    selected: tuple[int, int] | None       # (layer, expert) chosen in the Brain or the Atlas
    plots: bool = True                     # redraw the plots too, not only the figures (at most PLOT_HZ)
    counts: ExpertCounts | None = None     # the expert cache's per-expert counters (None: not streamed)
