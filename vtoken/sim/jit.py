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


@numba.njit(cache=True, nogil=True)
def layout_step(slot_of, token_at, victims, live, n, reuse, hole):
    """One step of a dense layout for every row (``vtoken.core`` semantics, see ``fast._Layout``).

    Evict ``victims`` (logical, [R, k]); with ``reuse`` the decode token ``n`` takes the lowest hole;
    holes below the new live count take the tail's tokens, highest slot first; without ``reuse`` the
    token is placed at ``live``. ``live`` is the count after eviction. Returns (moves, lower bound counted separately).
    """
    R, k = victims.shape
    extent = live + k  # dense before the step
    moves = 0
    bound = 0
    for r in range(R):
        holes = np.empty(k, np.int64)
        for j in range(k):
            s = slot_of[r, victims[r, j]]
            holes[j] = s
            token_at[r, s] = hole
            slot_of[r, victims[r, j]] = hole
        holes.sort()
        first = 0
        L = live
        if reuse:
            L = live + 1
            new_slot = extent
            if k > 0:
                new_slot = holes[0]
                first = 1
            slot_of[r, n] = new_slot
            token_at[r, new_slot] = n
        for src in range(L, extent):  # the lower bound: live tokens at or beyond the new live count
            if token_at[r, src] != hole:
                bound += 1
        h = first
        for src in range(extent - 1, L - 1, -1):
            tok = token_at[r, src]
            if tok == hole:
                continue
            while holes[h] >= L:  # cannot happen: as many holes below L as tokens above it
                h += 1
            dst = holes[h]
            h += 1
            token_at[r, dst] = tok
            token_at[r, src] = hole
            slot_of[r, tok] = dst
            moves += 1
        if not reuse:
            slot_of[r, n] = live
            token_at[r, live] = n
    return moves, bound
