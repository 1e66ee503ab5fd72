"""Fused per-step loops of the batched simulator (numba, compiled on first use and cached on disk).

Each loop performs the *same* IEEE operations, in the same order, as the numpy code it replaces
(``SyntheticSource._attn`` + the stats updates, ``ScorerPolicy.select_batch``'s argmin rounds), without
fast-math, so results stay bit-identical to the exact engine; ``tests/cpu/test_sim.py`` checks it.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def synthetic_step(w, z_s, logical, width, s, decay, band, keep, band_start, acc, last, bits,
                   need_acc, need_last, need_bits, threshold):
    """Attention of query ``s`` over each row's columns ``[0, width)``, folded into acc/last/bits.

    a = (w·keep [+ w·decay[min(s - i, band)] inside the band]) / Z(s)
    """
    R = w.shape[0]
    for r in range(R):
        zr = z_s[r]
        for c in range(width):
            wc = w[r, c]
            x = wc * keep
            if c >= band_start:
                d = s - logical[r, c]
                if d > band:
                    d = band
                x = x + wc * decay[d]
            a = x / zr
            if need_acc:
                acc[r, c] += a
            if need_last:
                last[r, c] = a
            if need_bits:
                bits[r, c] = (bits[r, c] << np.uint64(1)) | np.uint64(1 if a < threshold else 0)


@numba.njit(cache=True, nogil=True)
def lowest_k(scores, candidate, k, victims):
    """Mark the ``k`` lowest-scoring candidates per row (first index wins ties); returns False if a
    candidate's score is not finite."""
    R, C = scores.shape
    for r in range(R):
        for _ in range(k):
            best = -1
            best_v = np.inf
            for c in range(C):
                if candidate[r, c] and not victims[r, c]:
                    v = scores[r, c]
                    if not np.isfinite(v):
                        return False
                    if best == -1 or v < best_v:
                        best = c
                        best_v = v
            if best == -1:
                break
            victims[r, best] = True
    return True
