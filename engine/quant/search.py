"""Per-group scale (and offset) search: minimise the importance-weighted squared error.

For each group the search tries a grid of clip ratios. A candidate scale gives codes by rounding;
for those codes the least-squares scale (and offset, when asymmetric) is solved in closed form,
and the candidate's weighted error follows from the same sums without a second pass. The best
candidate is refined by a few rounds of re-rounding and re-fitting (Lloyd iterations). Scales and
offsets are then rounded to fp16 and the codes recomputed for the rounded values.

Importance c[k] >= 0 weighs input channel k (the mean squared activation it meets), so that
the error that counts, sum_k c[k] * (w - w_q)[r, k]^2, is what each group minimises.

About 1 s per 100 M weights on 2 threads (20 grid points). The search runs with fastmath, so on
another CPU its sums may round differently and a near tie pick another scale: a checkpoint's
codes are reproducible on one machine kind, the kernels' results on any.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.kernels.simd import U64

# Clip-ratio grids: fewer bits clip harder. Ratios multiply the absmax scale (symmetric) or the
# min-max range (asymmetric); ratios above 1 let rounding land better on the extremes.
_GRID_LOW = {8: 0.80, 6: 0.70, 5: 0.65, 4: 0.55, 3: 0.45, 2: 0.35}
GRID_POINTS = 20
REFINE_ROUNDS = 2


def clip_ratios(bits: int, search: bool) -> np.ndarray:
    """The clip ratios tried per group; empty without a search (plain absmax / min-max scales)."""
    if not search:
        return np.zeros(0, np.float64)
    return np.linspace(1.05, _GRID_LOW[bits], GRID_POINTS)


@njit(inline="always")
def _sym_fit(w, r, k0, group, c, base, inv_scale, lo, hi):
    """Codes q = clamp(rint(v / d)) of v = w[r, k0 : k0 + group] -> (least-squares d for them, weighted error)."""
    svq = 0.0
    sqq = 0.0
    svv = 0.0
    for k in range(k0, k0 + group):
        v = np.float64(w[U64(r), U64(k)])
        ck = c[U64(k)]
        q = min(max(np.rint(v * inv_scale), lo), hi)
        cv = ck * v
        svq += cv * q
        sqq += ck * q * q
        svv += cv * v
    if sqq <= 0.0:
        return base, svv
    return svq / sqq, svv - svq * svq / sqq


@njit(inline="always")
def _asym_fit(w, r, k0, group, c, d, m, top):
    """Codes u = clamp(rint((v - m) / d), 0, top) of v = w[r, k0 : k0 + group] -> (least-squares d, m, weighted error)."""
    s1 = su = suu = sv = svu = svv = 0.0
    inv = 1.0 / d
    for k in range(k0, k0 + group):
        v = np.float64(w[U64(r), U64(k)])
        u = min(max(np.rint((v - m) * inv), 0.0), top)
        ck = c[U64(k)]
        s1 += ck
        su += ck * u
        suu += ck * u * u
        sv += ck * v
        svu += ck * v * u
        svv += ck * v * v
    det = s1 * suu - su * su
    if det > 1e-12 * s1 * suu:
        d_ls = (s1 * svu - su * sv) / det
        m_ls = (suu * sv - su * svu) / det
    else:  # all codes equal: keep the scale, fit the offset
        d_ls = d
        m_ls = (sv - d * su) / s1
    err = svv - 2.0 * d_ls * svu - 2.0 * m_ls * sv + d_ls * d_ls * suu + 2.0 * d_ls * m_ls * su + m_ls * m_ls * s1
    return d_ls, m_ls, max(err, 0.0)


@njit(parallel=True, cache=True, fastmath=True)
def search_symmetric(w, c, bits, group, ratios, scales):
    """Best scale per group of w [R, K] for symmetric codes -N .. N-1 -> scales [R, K / group] (float32).

    With no ratios, the absmax scale (the largest magnitude maps to code -N) without any fit.
    """
    R, K = w.shape
    n = 1 << (bits - 1)
    lo = float(-n)
    hi = float(n - 1)
    for r in prange(R):
        for g in range(K // group):
            k0 = g * group
            peak = 0.0
            for k in range(k0, k0 + group):
                if abs(w[r, k]) > abs(peak):
                    peak = np.float64(w[r, k])
            if peak == 0.0:
                scales[r, g] = 0.0
                continue
            base = -peak / n  # the largest magnitude lands on code -N, the one extra negative level
            best_d = base
            if ratios.shape[0] == 0:
                scales[r, g] = base
                continue
            best_err = np.inf
            for ratio in ratios:
                d = base * ratio
                d_ls, err = _sym_fit(w, r, k0, group, c, d, 1.0 / d, lo, hi)
                if err < best_err and d_ls != 0.0:
                    best_err = err
                    best_d = d_ls
            for _ in range(REFINE_ROUNDS):
                d_ls, err = _sym_fit(w, r, k0, group, c, best_d, 1.0 / best_d, lo, hi)
                if err >= best_err or d_ls == 0.0:
                    break
                best_err = err
                best_d = d_ls
            scales[r, g] = best_d


@njit(parallel=True, cache=True, fastmath=True)
def search_asymmetric(w, c, bits, group, ratios, scales, mins):
    """Best (scale, offset) per group of w [R, K] for codes 0 .. 2**bits - 1 -> scales, mins [R, K / group].

    With no ratios, the min-max scale and offset without any fit.
    """
    R, K = w.shape
    top = float((1 << bits) - 1)
    for r in prange(R):
        for g in range(K // group):
            k0 = g * group
            vmin = np.inf
            vmax = -np.inf
            for k in range(k0, k0 + group):
                vmin = min(vmin, np.float64(w[r, k]))
                vmax = max(vmax, np.float64(w[r, k]))
            if vmax == vmin:
                scales[r, g] = 0.0
                mins[r, g] = vmin
                continue
            best_d = (vmax - vmin) / top
            best_m = vmin
            if ratios.shape[0] == 0:
                scales[r, g] = best_d
                mins[r, g] = best_m
                continue
            best_err = np.inf
            for ratio in ratios:
                d = ratio * (vmax - vmin) / top
                m = 0.5 * (vmin + vmax) - 0.5 * top * d  # shrink the range about its centre
                d_ls, m_ls, err = _asym_fit(w, r, k0, group, c, d, m, top)
                if err < best_err and d_ls > 0.0:
                    best_err = err
                    best_d = d_ls
                    best_m = m_ls
            for _ in range(REFINE_ROUNDS):
                d_ls, m_ls, err = _asym_fit(w, r, k0, group, c, best_d, best_m, top)
                if err >= best_err or d_ls <= 0.0:
                    break
                best_err = err
                best_d = d_ls
                best_m = m_ls
            scales[r, g] = best_d
            mins[r, g] = best_m


@njit(parallel=True, cache=True)
def encode(w, bits, group, asym, d, m, codes):
    """Codes [R, K] (uint8) of w for the final (fp16-rounded) d and m [R, K / group], nearest rounding."""
    R, K = w.shape
    top = float((1 << bits) - 1)
    half = float(1 << (bits - 1))
    for r in prange(R):
        for g in range(K // group):
            dg = np.float64(d[r, g])
            inv = 1.0 / dg if dg != 0.0 else 0.0
            mg = np.float64(m[r, g]) if asym else -half * dg
            for k in range(g * group, (g + 1) * group):
                u = np.rint((np.float64(w[r, k]) - mg) * inv)
                codes[r, k] = np.uint8(min(max(u, 0.0), top))


@njit(parallel=True, cache=True)
def encoded_error(w, c, bits, group, asym, d, m, err):
    """err[r] = sum_k c[k] * (w - w_q)[r, k]^2 for the codes `encode` gives with d and m [R, K / group]: the
    weighted error of a format measured without building its codes (the planner's candidates)."""
    R, K = w.shape
    top = float((1 << bits) - 1)
    half = float(1 << (bits - 1))
    for r in prange(R):
        acc = 0.0
        for g in range(K // group):
            dg = np.float64(d[r, g])
            inv = 1.0 / dg if dg != 0.0 else 0.0
            mg = np.float64(m[r, g]) if asym else -half * dg
            d32 = np.float32(dg)
            m32 = np.float32(mg)
            for k in range(g * group, (g + 1) * group):
                v = np.float64(w[r, k])
                u = min(max(np.rint((v - mg) * inv), 0.0), top)
                diff = v - np.float64(np.float32(u) * d32 + m32)   # dequantized as QuantizedTensor does, in float32
                acc += c[k] * diff * diff
        err[r] = acc
