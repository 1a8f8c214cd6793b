"""Kimi delta attention's recurrence (engine/blocks/kda.py), one compiled loop over a step's tokens.

The gated delta rule of engine/kernels/deltanet.py with the decay per key channel: row a of a head's matrix
S [Dk, Dv] decays by its own factor exp(g[a]) each token. Each head runs on its own thread; sums over Dk run
in index order, the same for every token whatever the step's length, so a token's bits do not depend on how
a prompt was split or batched. No fastmath.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

F32 = np.float32


@njit(parallel=True, cache=True, boundscheck=False)
def kda_rule(rec, q, k, v, decay, beta, out):
    """Run tokens through the recurrence, updating rec [H, Dk, Dv] in place; outputs to out [T, H, Dv].

    q, k [T, H, Dk] (q already scaled), v [T, H, Dv], decay (the factors exp(g)) [T, H, Dk], beta [T, H];
    float32.
    """
    t_len, heads, dk = q.shape
    dv = v.shape[2]
    for h in prange(heads):
        delta = np.empty(dv, F32)
        for t in range(t_len):
            for j in range(dv):
                delta[j] = F32(0.0)
            for a in range(dk):                        # decay row a of S, read k's prediction of v
                ka, decay_a = k[t, h, a], decay[t, h, a]
                for j in range(dv):
                    x = rec[h, a, j] * decay_a
                    rec[h, a, j] = x
                    delta[j] += x * ka
            beta_t = beta[t, h]
            for j in range(dv):
                delta[j] = (v[t, h, j] - delta[j]) * beta_t
                out[t, h, j] = F32(0.0)
            for a in range(dk):                        # write the correction, read the output
                ka, qa = k[t, h, a], q[t, h, a]
                for j in range(dv):
                    x = rec[h, a, j] + ka * delta[j]
                    rec[h, a, j] = x
                    out[t, h, j] += x * qa
