"""The statistics of the expert atlas, from a routing log: plain numpy, no model needed.

The log is `counts[layer][expert, topic, half]`: how often each expert was chosen by tokens of each
topic's prompts, the prompts split in halves (even and odd). From it, for every (layer, expert):

- topic distribution: the expert's selection rate in each topic (count / the topic's tokens),
  normalised to sum to 1, so that topics with longer prompts do not weigh more;
- specialisation: 1 - H(distribution) / log(topics): 0 for an expert chosen at the same rate in
  every topic, 1 for one chosen in a single topic only;
- top topic, and whether it reproduces: the top topic of the even half equals that of the odd;
- a 3D position: classical MDS of the Hellinger distance between distributions, which is PCA of
  the distributions' square roots (unit vectors), over every expert of every layer at once.
  Experts never chosen sit at the uniform distribution's place. Each axis's share of the spread (its
  explained variance) says how much of the picture it carries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PROJECTION = ("classical MDS of the Hellinger distance between topic distributions "
              "(= PCA of their square roots), all layers together")


@dataclass(frozen=True)
class ExpertStats:
    """What the atlas says about one expert."""

    layer: int
    expert: int
    selections: int
    topic_counts: tuple[int, ...]           # [topics] times chosen per topic
    distribution: tuple[float, ...]         # [topics] rate-normalised, sums to 1 (all 0 if never chosen)
    specialisation: float                   # 0 (uniform) .. 1 (one topic)
    top_topic: int | None                   # index into the topics; None if never chosen
    reproduces: bool                        # the top topic is the same on both halves of the prompts
    position: tuple[float, float, float]


def topic_distribution(counts: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Selection rates per topic, normalised: counts [..., T] over tokens [T] -> [..., T] (0 where unused)."""
    rates = counts / np.maximum(tokens, 1)
    total = rates.sum(axis=-1, keepdims=True)
    return np.where(total > 0, rates / np.where(total > 0, total, 1), 0.0)


def specialisation(p: np.ndarray) -> np.ndarray:
    """1 - normalised entropy of distributions p [..., T] (0 for an all-zero row)."""
    t = p.shape[-1]
    logs = np.log(np.where(p > 0, p, 1.0))
    entropy = -(p * logs).sum(axis=-1) / np.log(t)
    return np.where(p.sum(axis=-1) > 0, 1.0 - entropy, 0.0)


def _centred_roots(p: np.ndarray) -> np.ndarray:
    """The square roots of distributions p [N, T], centred [N, T]; an all-zero row counts as uniform."""
    t = p.shape[1]
    unused = p.sum(axis=1) == 0
    roots = np.sqrt(np.where(unused[:, None], 1.0 / t, p))                 # [N, T] unit vectors
    return roots - roots.mean(axis=0)


def positions_3d(p: np.ndarray) -> np.ndarray:
    """3D points [N, 3] for distributions p [N, T]: classical MDS on Hellinger distance (PCA of sqrt p)."""
    n = p.shape[0]
    u, s, vt = np.linalg.svd(_centred_roots(p), full_matrices=False)
    k = min(3, len(s))
    coords = u[:, :k] * s[:k]                                              # [N, k]
    for j in range(k):  # a fixed sign per axis: the topic weighing most on it points to +
        if vt[j, np.argmax(np.abs(vt[j]))] < 0:
            coords[:, j] = -coords[:, j]
    out = np.zeros((n, 3))
    out[:, :k] = coords
    return out


def explained_variance(p: np.ndarray) -> np.ndarray:
    """The share (0..1) [3] of the squared Hellinger spread of distributions p [N, T] along each axis of
    `positions_3d` (0 past the axes the data has; all 0 when every point is at the same place)."""
    out = np.zeros(3)
    if not p.size:
        return out
    s = np.linalg.svd(_centred_roots(p), compute_uv=False)                # [min(N, T)]
    total = float((s**2).sum())
    k = min(3, len(s))
    if total > 0:
        out[:k] = s[:k] ** 2 / total
    return out


def expert_stats(counts: dict[int, np.ndarray], tokens: np.ndarray) -> list[ExpertStats]:
    """Stats of every expert from counts {layer: [E, T, 2]} and the topics' routed tokens [T, 2]."""
    layers = sorted(counts)
    rows = [(layer, e) for layer in layers for e in range(counts[layer].shape[0])]
    if not rows:
        return []
    full = np.concatenate([counts[layer].sum(axis=2) for layer in layers]).astype(np.float64)   # [N, T]
    dist = topic_distribution(full, tokens.sum(axis=1))
    spec = specialisation(dist)
    halves = [topic_distribution(np.concatenate([counts[layer][:, :, h] for layer in layers]).astype(np.float64),
                                 tokens[:, h]) for h in (0, 1)]
    pos = positions_3d(dist)
    out = []
    for n, (layer, e) in enumerate(rows):
        used = full[n].sum() > 0
        top = int(np.argmax(dist[n])) if used else None
        a, b = halves[0][n], halves[1][n]
        reproduces = bool(a.sum() > 0 and b.sum() > 0 and np.argmax(a) == np.argmax(b))
        out.append(ExpertStats(layer, e, int(full[n].sum()), tuple(int(c) for c in full[n]),
                               tuple(float(x) for x in dist[n]), float(spec[n]), top, reproduces,
                               tuple(float(x) for x in pos[n])))
    return out


def text_report(stats: list[ExpertStats], topics: list[str], per_topic: int = 3, min_selections: int = 20) -> str:
    """The most specialised experts per topic, and the share of experts whose top topic reproduces."""
    lines = [f"most specialised experts per topic (layer.expert specialisation, + reproduces on held-out prompts; "
             f"experts chosen at least {min_selections} times):"]
    width = max(len(t) for t in topics)
    for j, topic in enumerate(topics):
        mine = sorted((s for s in stats if s.top_topic == j and s.selections >= min_selections),
                      key=lambda s: -s.specialisation)[:per_topic]
        cells = [f"L{s.layer}.e{s.expert} {s.specialisation:.2f}{'+' if s.reproduces else ' '}" for s in mine]
        lines.append(f"  {topic:<{width}}  " + ("   ".join(cells) if cells else "(no expert prefers it)"))
    used = [s for s in stats if s.selections > 0]
    repro = sum(s.reproduces for s in used)
    if used:
        lines.append(f"experts whose top topic reproduces on held-out prompts: {repro}/{len(used)} "
                     f"({100 * repro / len(used):.0f}%; chance is about {100 / len(topics):.0f}%)")
        lines.append(f"mean specialisation {np.mean([s.specialisation for s in used]):.3f}; "
                     f"{len(stats) - len(used)} experts never chosen")
    return "\n".join(lines)
