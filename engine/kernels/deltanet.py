"""The gated delta rule's recurrence (engine/blocks/deltanet.py), one compiled loop over a step's tokens.

Each value head runs on its own thread. Per token the head's matrix S [Dk, Dv] is read twice: once to
decay it and read what it predicts for the key, once to write the correction and read the output.
Sums over Dk run in index order, the same for every token whatever the step's length, so a token's
bits do not depend on how a prompt was split or batched. No fastmath.

The states a caller keeps (after every token of a short step, at block boundaries for the prefix
cache's checkpoints) are copied out inside the same call: a step is one call whatever it keeps.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

F32 = np.float32


@njit(parallel=True, cache=True, boundscheck=False)
def delta_rule(rec, q, k, v, decay, beta, out, keep, kept):
    """Run tokens through the recurrence, updating rec [H, Dk, Dv] in place; outputs to out [T, H, Dv].

    q, k [T, H, Dk] (q already scaled), v [T, H, Dv], decay (the factor exp(g)) and beta [T, H]; float32.
    keep [M] (int64, increasing, each in 1..T): after that many tokens the matrices are copied into
    kept [M, H, Dk, Dv] (M may be 0).
    """
    t_len, heads, dk = q.shape
    dv = v.shape[2]
    n_keep = keep.shape[0]
    for h in prange(heads):
        delta = np.empty(dv, F32)
        m = 0
        for t in range(t_len):
            decay_t = decay[t, h]
            for j in range(dv):
                delta[j] = F32(0.0)
            for a in range(dk):                        # decay S and read k's prediction of v
                ka = k[t, h, a]
                for j in range(dv):
                    x = rec[h, a, j] * decay_t
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
            while m < n_keep and keep[m] == t + 1:     # the state after t + 1 tokens, for the caller to keep
                for a in range(dk):
                    for j in range(dv):
                        kept[m, h, a, j] = rec[h, a, j]
                m += 1
