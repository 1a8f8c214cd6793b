"""The Brain's colour maps and filters, in numpy: what colours each expert's cell, and which cells are dimmed.

Each map makes one float32 image [L, E, 3] from whole grids, never a loop over experts, so 19,456 experts cost a few
array operations a frame:

- TIERS: hue is the expert's tier, brightness its heat (decayed routing count, log-scaled against the hottest); a cold
  expert keeps its tier's hue at a floor of brightness, so even a never-routed one on disk reads as disk, not black.
- TOPIC: the expert's strongest atlas topic in the Atlas's categorical colours (`Theme.topic`), brightness its heat;
  an expert the atlas does not know, or its probes never chose, in the neutral grey.
- RECENCY: the tokens since a step last chose the expert (`ExpertCounts.since_routed`), log-scaled against the
  longest wait on a sequential ramp, the latest token brightest; never chosen in the grey.
- AHEAD: the share of its reads ahead that a step then used, on a diverging ramp from all wasted to all used; no
  reads ahead in the grey.

The ramps are opaque colours of their own, none of them the flash yellow or the grey, and read the same on light
and dark backgrounds. Filters never remove a cell: a filtered one keeps DIMMED of its colour over the background, so
the grid keeps its geometry and hover and click still find it.
"""

from __future__ import annotations

import numpy as np

from engine.offload.story import ExpertCounts
from ui.inspector.common import RGB, Theme
from ui.inspector.data import TIER_CACHED, TIER_DISK, TIER_NONE, TIER_PINNED, TIER_RESIDENT, TIER_UNKNOWN, AtlasData

MAP_TIERS, MAP_TOPIC, MAP_RECENCY, MAP_AHEAD = "tiers", "topic", "recency", "ahead"
MAPS = (MAP_TIERS, MAP_TOPIC, MAP_RECENCY, MAP_AHEAD)
DIMMED = 0.15            # the share of its colour a filtered cell keeps over the background
TOPIC_FLOOR = 0.5        # a never-routed expert's topic colour, as a share of it at full heat: hues stay apart

_CODES = (TIER_NONE, TIER_DISK, TIER_CACHED, TIER_PINNED, TIER_RESIDENT, TIER_UNKNOWN)  # LUT row = code + 1
# The brightness of a never-routed cell, as a share of its tier's brightest colour: a cold expert in RAM stays
# plainly coloured, a cold one on disk is a darker slate (its hue still plain on either background), and heat
# brightens both toward full.
_FLOOR = np.array([0.0, 0.5, 0.6, 0.6, 0.6, 0.4], np.float32)


def _ramp(*stops: tuple[float, RGB], n: int = 256) -> np.ndarray:
    """A colour ramp [n, 3] float32 through (position 0..1, colour) stops, linear in RGB between them."""
    at = np.linspace(0.0, 1.0, n)
    pos = [p for p, _ in stops]
    return np.stack([np.interp(at, pos, [c[i] for _, c in stops]) for i in range(3)], axis=1).astype(np.float32)


# Recency, oldest (0) to the latest token (1): deep blue, teal, pale mint; darkest to lightest on either theme
RECENCY = _ramp((0.0, (30, 40, 105)), (0.5, (30, 140, 160)), (1.0, (185, 250, 215)))
# Read ahead, all wasted (0) to all used (1): red, pale sand, blue
AHEAD = _ramp((0.0, (210, 50, 40)), (0.5, (235, 222, 185)), (1.0, (35, 115, 205)))


def ramp_colour(ramp: np.ndarray, x: float) -> RGB:
    """The colour of a ramp at x (0..1), as the grid draws it."""
    r, g, b = ramp[int(round(min(max(x, 0.0), 1.0) * (len(ramp) - 1)))]
    return int(r), int(g), int(b)


def brightest(rgb: RGB) -> np.ndarray:
    """The colour of rgb's hue and saturation at full brightness (its largest channel at 255), float32 [3]."""
    c = np.array(rgb, np.float32)
    return c * (255.0 / max(float(c.max()), 1.0))


def fit(a: np.ndarray | None, shape: tuple[int, int], fill: float, dtype: type) -> np.ndarray:
    """`a` cropped or padded with `fill` to `shape` (a new array)."""
    out = np.full(shape, fill, dtype)
    if a is not None and a.ndim == 2:
        rows, cols = min(shape[0], a.shape[0]), min(shape[1], a.shape[1])
        out[:rows, :cols] = a[:rows, :cols]
    return out


def tier_codes(tiers: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray:
    """[L, E] int8 tier codes of the grid: TIER_NONE past the tiers given, TIER_UNKNOWN everywhere without them."""
    return fit(tiers, shape, TIER_NONE, np.int8) if tiers is not None else np.full(shape, TIER_UNKNOWN, np.int8)


def heat_level(heat: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray:
    """[L, E] float32 0..1: heat log-scaled against the hottest expert (0 everywhere without heat)."""
    h = fit(heat, shape, 0.0, np.float32)
    hmax = float(h.max()) if h.size else 0.0
    return (np.log1p(h) / np.log1p(hmax)).astype(np.float32) if hmax > 0 else h


def topic_grid(atlas: AtlasData | None, shape: tuple[int, int]) -> np.ndarray:
    """[L, E] int64: each expert's strongest atlas topic, -1 where the atlas has none (or there is no atlas)."""
    grid = np.full(shape, -1, np.int64)
    if atlas is not None and len(atlas):
        keys = atlas.keys                                                     # [N, 2]
        inside = (keys[:, 0] < shape[0]) & (keys[:, 1] < shape[1]) & (keys >= 0).all(axis=1)
        grid[keys[inside, 0], keys[inside, 1]] = atlas.top[inside]
    return grid


def tier_rgb(theme: Theme, codes: np.ndarray, level: np.ndarray) -> np.ndarray:
    """TIERS: [L, E, 3] float32, the tier's hue brightened by heat from its floor."""
    lut = np.array([brightest(theme.tiers.get(c, theme.background)) for c in _CODES], np.float32)   # [6, 3]
    floor = _FLOOR[codes + 1]                                                                         # [L, E]
    value = floor + (1.0 - floor) * level
    return lut[codes + 1] * value[..., None]


def tier_colour(theme: Theme, code: int, level: float) -> RGB:
    """The colour the TIERS map draws for an expert of tier `code` at heat level 0 (cold) .. 1 (hottest)."""
    rgb = tier_rgb(theme, np.array([[code]], np.int8), np.array([[level]], np.float32))[0, 0]
    r, g, b = rgb.astype(np.uint8)      # as the Brain's image takes it
    return int(r), int(g), int(b)


def topic_rgb(theme: Theme, topics: np.ndarray, level: np.ndarray) -> np.ndarray:
    """TOPIC: [L, E, 3] float32, the topic's colour brightened by heat from TOPIC_FLOOR; the grey without one."""
    n = int(topics.max()) + 1 if topics.size else 0
    lut = np.array([theme.topic(t) for t in range(n)] + [theme.unused], np.float32)   # [T + 1, 3], -1 -> the grey
    value = TOPIC_FLOOR + (1.0 - TOPIC_FLOOR) * level
    rgb = lut[topics] * value[..., None]
    rgb[topics < 0] = theme.unused
    return rgb


def recency_rgb(theme: Theme, counts: ExpertCounts | None, shape: tuple[int, int]) -> np.ndarray:
    """RECENCY: [L, E, 3] float32, the tokens since each expert was last chosen on the RECENCY ramp; the grey for
    experts never chosen (and everywhere without counters)."""
    since = fit(counts.since_routed() if counts is not None else None, shape, -1, np.int64)   # [L, E]
    longest = int(since.max()) if since.size else -1
    level = 1.0 - np.log1p(np.maximum(since, 0)) / np.log1p(longest) if longest > 0 else np.ones(shape)
    rgb = RECENCY[np.rint(level * (len(RECENCY) - 1)).astype(np.intp)]
    rgb[since < 0] = theme.unused
    return rgb


def ahead_rgb(theme: Theme, counts: ExpertCounts | None, shape: tuple[int, int]) -> np.ndarray:
    """AHEAD: [L, E, 3] float32, the share of each expert's reads ahead used on the AHEAD ramp; the grey for experts
    without any (and everywhere without counters)."""
    used = fit(counts.ahead_used if counts is not None else None, shape, 0, np.int64)         # [L, E]
    wasted = fit(counts.ahead_wasted if counts is not None else None, shape, 0, np.int64)     # [L, E]
    guesses = used + wasted
    share = used / np.maximum(guesses, 1)
    rgb = AHEAD[np.rint(share * (len(AHEAD) - 1)).astype(np.intp)]
    rgb[guesses == 0] = theme.unused
    return rgb


def map_rgb(colour_map: str, theme: Theme, codes: np.ndarray, level: np.ndarray, topics: np.ndarray | None,
            counts: ExpertCounts | None) -> np.ndarray:
    """The [L, E, 3] float32 image of one map (TIERS for a name no map has)."""
    shape = codes.shape
    if colour_map == MAP_TOPIC:
        return topic_rgb(theme, topics if topics is not None else np.full(shape, -1, np.int64), level)
    if colour_map == MAP_RECENCY:
        return recency_rgb(theme, counts, shape)
    if colour_map == MAP_AHEAD:
        return ahead_rgb(theme, counts, shape)
    return tier_rgb(theme, codes, level)


def filtered(codes: np.ndarray, shown_tiers: frozenset[int], topics: np.ndarray | None,
             topic: int | None) -> np.ndarray:
    """[L, E] bool: the experts the filters leave out: of a tier not shown, or (topic not None) of another topic.
    Cells without an expert are never filtered; without tiers, the tier filter has nothing to go by."""
    left_out = np.array([c not in shown_tiers and c not in (TIER_NONE, TIER_UNKNOWN) for c in _CODES])   # [6]
    out = left_out[codes + 1]                                                                            # [L, E]
    if topic is not None:
        out |= (topics != topic) if topics is not None else True
        out &= codes != TIER_NONE
    return out


def dim(rgba: np.ndarray, cells: np.ndarray, theme: Theme) -> None:
    """Mix the `cells` [L, E] of an image [L, E, 4] uint8 toward the background, in place (DIMMED of them stays)."""
    if cells.any():   # the whole image mixed, then copied where filtered: cheaper than gathering the cells
        rgb = rgba[..., :3]
        mixed = rgb * np.float32(DIMMED) + np.array(theme.background, np.float32) * np.float32(1 - DIMMED)
        np.copyto(rgb, mixed.astype(np.uint8), where=cells[..., None])
