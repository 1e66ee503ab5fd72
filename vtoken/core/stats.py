"""Per-token attention statistics that policies score from, and how a step's scores update them.

A step's queries (one decode token, or a prefill chunk) attend over the request's live keys. The
worker (or a trace) reduces the attention probabilities over heads and layers by their mean and hands
back one ``StepScores`` per request. ``observe()`` folds it into the token table:

  * ``acc``          += Σ over the step's queries of the key's attention   (H2O)
  * ``last``          = attention from the step's last query               (TOVA)
  * ``unimportant``   = history bitmask; bit j set ⇔ the j-th most recent query gave the key less
                        than the uniform share 1/(keys that query saw)      (Scissorhands)
  * ``key_norm``      = mean L2 norm of the key over heads and layers, set once when written (KNorm)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HISTORY_BITS = 64  # the unimportance history is a uint64 bitmask: at most 64 recent queries


@dataclass(frozen=True)
class StepScores:
    """One request's attention statistics for one step (all arrays aligned with ``logicals``)."""

    logicals: np.ndarray  # int64 [k]: the live keys the step's queries attended
    attn_sum: np.ndarray  # float [k]
    attn_last: np.ndarray  # float [k]
    unimportant_bits: np.ndarray  # uint64 [k]
    n_queries: int
    key_norm_logicals: np.ndarray | None = None  # tokens written this step …
    key_norm: np.ndarray | None = None  # … and their key norms


def shift_history(bits: np.ndarray, n_queries: int, new_bits: np.ndarray) -> np.ndarray:
    """Push ``n_queries`` newer queries' bits into a uint64 history (the oldest fall off)."""
    if n_queries >= HISTORY_BITS:
        return new_bits.astype(np.uint64)
    return (bits << np.uint64(n_queries)) | new_bits.astype(np.uint64)


def unimportance_bits(probs: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """History bits from the last ≤64 queries' attention rows.

    ``probs``: [q, k] attention of each query over the keys (mean over heads/layers), oldest query first.
    ``visible``: [q, k] bool, which keys each query could see (causal mask). A key a query could not see
    is not judged by that query. Bit 0 is the newest query.
    """
    q = probs.shape[0]
    rows = probs[max(0, q - HISTORY_BITS) :]
    vis = visible[max(0, q - HISTORY_BITS) :]
    n_vis = np.maximum(vis.sum(axis=1, keepdims=True), 1)
    low = (rows < 1.0 / n_vis) & vis  # [h, k]
    weights = np.uint64(1) << np.arange(low.shape[0] - 1, -1, -1, dtype=np.uint64)  # newest -> bit 0
    return (low.astype(np.uint64) * weights[:, None]).sum(axis=0, dtype=np.uint64)


def observe(table, scores: StepScores) -> None:
    """Fold one step's scores into ``table``'s per-token state (mutates the table).

    Scores for tokens evicted since the step ran are ignored (their state is dead anyway).
    """
    idx = np.asarray(scores.logicals, dtype=np.int64)
    if idx.size:
        keep = idx < table.seen
        idx = idx[keep]
        table.acc[idx] += np.asarray(scores.attn_sum)[keep]
        table.last[: table.seen] = 0.0
        table.last[idx] = np.asarray(scores.attn_last)[keep]
        table.unimportant[idx] = shift_history(
            table.unimportant[idx], scores.n_queries, np.asarray(scores.unimportant_bits)[keep]
        )
    if scores.key_norm_logicals is not None and scores.key_norm is not None:
        table.key_norm[np.asarray(scores.key_norm_logicals, dtype=np.int64)] = scores.key_norm
