"""Routers for an upcycled MoE: spherical k-means of one layer's feed-forward inputs, as a linear map.

A Mixtral router is a bias-free matrix R [E, hidden]: a token h goes to argmax_e R_e . h. Nearest-
centroid assignment under cosine similarity is exactly that map, because argmax over experts does
not change when a token's scores are all scaled by the same positive number (its norm). Two more
steps keep it linear:

- The inputs share a large common direction u (their mean; massive activations live there) that
  would dominate every cosine. Clustering runs on h minus its component along u, and the centroids
  c_e are orthogonal to u, so c_e . h is the clustering's score for the unnormalised h.
- Clusters of natural text are uneven. u . h is positive for every token but the attention sink
  (position 0), so a term b_e (u . h) added to expert e's score acts as a per-expert bias: b is
  tuned until the calibration tokens spread evenly (top-k counts), as aux-loss-free balancing does.

So R_e = c_e + b_e u. Everything is seeded: the same inputs and seed give the same router.
"""

from __future__ import annotations

import numpy as np

from engine.errors import ColibriError

KMEANS_ITERS = 60      # Lloyd iterations at most (they usually settle well before)
KMEANS_RESTARTS = 3    # k-means++ starts per layer; the tightest clustering wins
BALANCE_ITERS = 200    # bias updates; the step shrinks linearly to zero


def fit_router(x: np.ndarray, n_experts: int, top_k: int, seed: int, balance: bool = True) -> np.ndarray:
    """Router [E, hidden] float32 from feed-forward inputs x [N, hidden] of one layer."""
    if x.ndim != 2 or x.shape[0] < 4 * n_experts:
        raise ColibriError(
            f"{x.shape[0]} calibration tokens are too few for {n_experts} experts (need at least "
            f"{4 * n_experts}); give a longer --calib file or answer more prompts"
        )
    x64 = x.astype(np.float64)
    u = x64.mean(axis=0)
    u /= np.linalg.norm(u)                                              # [H] the common direction
    gain = x64 @ u                                                      # [N] u . h, the bias carrier
    z = x64 - np.outer(gain, u)                                         # [N, H] h without u
    zn = z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)
    rng = np.random.default_rng(seed)
    centroids = _spherical_kmeans(zn, n_experts, rng)                  # [E, H] unit, orthogonal to u
    bias = _balance(z @ centroids.T, gain, top_k) if balance else np.zeros(n_experts)
    return (centroids + bias[:, None] * u[None, :]).astype(np.float32)


def route_top_k(x: np.ndarray, router: np.ndarray, top_k: int) -> np.ndarray:
    """Expert ids [N, K] a router picks for inputs x [N, hidden] (highest score first)."""
    scores = x.astype(np.float32) @ router.T                            # [N, E]
    return np.argsort(-scores, axis=1, kind="stable")[:, :top_k]


def _spherical_kmeans(zn: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Unit centroids [k, H] of unit rows zn [N, H]: the best of a few k-means++ starts."""
    best, best_cost = None, np.inf
    for _ in range(KMEANS_RESTARTS):
        centroids = _kmeans_pp(zn, k, rng)
        for _ in range(KMEANS_ITERS):
            assign = np.argmax(zn @ centroids.T, axis=1)                # [N]
            sums = np.eye(k)[assign].T @ zn                                # [k, H] per-cluster sums
            norms = np.linalg.norm(sums, axis=1, keepdims=True)
            empty = norms[:, 0] < 1e-12
            if empty.any():  # an emptied cluster restarts on the token farthest from its centroid
                far = np.argsort(np.max(zn @ centroids.T, axis=1))[: int(empty.sum())]
                sums[empty], norms[empty] = zn[far], 1.0
            new = sums / norms
            done = np.allclose(new, centroids, atol=1e-7)
            centroids = new
            if done:
                break
        cost = float(np.sum(1.0 - np.max(zn @ centroids.T, axis=1)))
        if cost < best_cost:
            best, best_cost = centroids, cost
    assert best is not None
    return best


def _kmeans_pp(zn: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding under cosine distance."""
    chosen = [zn[rng.integers(len(zn))]]
    for _ in range(k - 1):
        dist = np.maximum(1.0 - np.max(zn @ np.array(chosen).T, axis=1), 0.0)
        total = dist.sum()
        pick = rng.choice(len(zn), p=dist / total) if total > 0 else rng.integers(len(zn))
        chosen.append(zn[pick])
    return np.array(chosen)


def _balance(scores: np.ndarray, gain: np.ndarray, top_k: int) -> np.ndarray:
    """Biases b [E] that make the top-k picks of scores + gain * b even over the calibration tokens."""
    n, e = scores.shape
    ordered = np.sort(scores / np.where(np.abs(gain) > 1e-12, gain, 1e-12)[:, None], axis=1)
    step = float(np.median(ordered[:, -top_k] - ordered[:, -top_k - 1])) if e > top_k else 0.0
    bias = np.zeros(e)
    for i in range(BALANCE_ITERS):
        picks = np.argpartition(-(scores + gain[:, None] * bias), top_k - 1, axis=1)[:, :top_k]
        shares = np.bincount(picks.reshape(-1), minlength=e) / (n * top_k)
        bias -= step * (shares * e - 1.0) * (1.0 - i / BALANCE_ITERS)
    return bias
