"""One step's per-token statistics, and how they update a token table.

The statistics and their names are declared once in ``vtoken.policies.context`` (``Stat``); every field
below is named by one. A step's queries (one decode token, or a prefill chunk) attend over the request's
live keys; the worker (or a trace) reduces the attention probabilities over heads and layers by their
mean and hands back one ``SlotScores`` per request, indexed by *row slot* (the worker knows no logical
positions). The scheduler turns it into ``StepScores`` (indexed by logical position) through the token
table, and ``observe()`` folds that into the table:

  * ``accumulated``  += Σ over the step's queries of the key's attention
  * ``last``          = attention from the step's last query (every other live token: 0)
  * ``unimportant``   = history bits shifted by the step's queries, the step's bits in (bit 0: newest)
  * ``key_norm``      = the new keys' norms, set once when written
  * ``window``        = Σ over the prompt's last ≤ ``OBSERVATION_WINDOW`` queries, *set* (not accumulated)
                        by the one step that computes the prompt's last token (others carry ``None``)
  * ``redundancy``    = each live key's mean cosine similarity to the step's other live keys (every other
                        token: 0); *set*, like ``last``, by every step that measured it (``mean_cosine``)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vtoken.policies.context import HISTORY_BITS


@dataclass(frozen=True)
class StepScores:
    """One request's statistics for one step, by logical position (attention arrays aligned with
    ``logicals``; ``key_norm`` aligned with ``key_norm_logicals``). Absent statistics are ``None``."""

    logicals: np.ndarray  # int64 [k]: the live keys the step's queries attended
    n_queries: int
    accumulated: np.ndarray | None = None  # float [k]: Σ over the step's queries
    last: np.ndarray | None = None  # float [k]: the step's last query
    unimportant: np.ndarray | None = None  # uint64 [k]: the step's bits, bit 0 = its newest query
    key_norm_logicals: np.ndarray | None = None  # tokens written this step …
    key_norm: np.ndarray | None = None  # … and their key norms
    window: np.ndarray | None = None  # float [k]: Σ over the observation window (the prompt's end step only)
    redundancy: np.ndarray | None = None  # float [k]: mean cosine similarity to the other live keys (R-KV)
    first: int = 0  # logical tokens below it were never scored (the protected prefix: slot = logical there)


@dataclass(frozen=True)
class SlotScores:
    """What the worker measured for one request in one step: the typed worker → scheduler boundary.

    Attention statistics cover the request's row slots ``first..seq_len-1`` (its dense live keys, in slot
    order; slots below ``first`` hold tokens that are never evictable, ``vtoken.core.scored_range``, and are
    not scored) and are ``None`` when they were not asked for; ``key_norm`` holds the step's ``n_queries`` new
    keys' norms in order (preceded by those of prefix-cache hits the step was asked for), or ``None``;
    ``window`` covers the row slots too, only on the step that computed the prompt's last token;
    ``redundancy`` covers them when asked for (R-KV). Plain numpy: it is pickled across the engine's process
    boundary.
    """

    n_queries: int
    seq_len: int
    accumulated: np.ndarray | None = None
    last: np.ndarray | None = None
    unimportant: np.ndarray | None = None
    key_norm: np.ndarray | None = None
    window: np.ndarray | None = None
    redundancy: np.ndarray | None = None
    first: int = 0  # the attention statistics' first row slot (they hold seq_len - first entries)

    def by_logical(self, token_at: np.ndarray, first_new: int) -> StepScores:
        """Map slots to logical positions through the table's ``token_at`` (holes are dropped); the key norms
        are of logical ``first_new ..`` in order (the new keys, after any cache-hit keys) (pure)."""
        kn = self.key_norm
        new = np.arange(first_new, first_new + len(kn), dtype=np.int64) if kn is not None else None
        if self.accumulated is None:
            return StepScores(np.zeros(0, np.int64), self.n_queries, key_norm_logicals=new, key_norm=self.key_norm)
        logicals = np.array(token_at[self.first : self.seq_len], dtype=np.int64)  # a copy: the map changes
        ok = slice(None) if logicals.min(initial=0) >= 0 else logicals >= 0  # a dense row: no copies
        return StepScores(
            logicals=logicals[ok],
            n_queries=self.n_queries,
            accumulated=np.asarray(self.accumulated)[ok],
            last=np.asarray(self.last)[ok],
            unimportant=np.asarray(self.unimportant, dtype=np.uint64)[ok],
            key_norm_logicals=new,
            key_norm=self.key_norm,
            window=None if self.window is None else np.asarray(self.window)[ok],
            redundancy=None if self.redundancy is None else np.asarray(self.redundancy)[ok],
            first=self.first,
        )


def window_queries(num_prompt_tokens: int, computed_before: int, n: int) -> int:
    """How many of a step's ``n`` queries (logical ``computed_before ..``) run up to the prompt's last token
    when the step computes it (the prefill's last chunk, or a recompute after a preemption, which may go on
    past the prompt); 0 for every other step. The observation window is the last ≤ ``OBSERVATION_WINDOW``
    of them (pure)."""
    end = num_prompt_tokens - computed_before
    return end if 0 < end <= n else 0


def mean_cosine(keys: np.ndarray) -> np.ndarray:
    """``redundancy`` of ``keys`` ``[n, heads, d]`` (numpy twin of ``vtoken.kernels.scores.key_redundancy``):
    per head, each key's mean cosine similarity to the other ``n − 1``, from the unit keys' sum in O(n·d)::

        mean_{j≠i} cos(k_i, k_j) = (k̂_i · Σ_j k̂_j − k̂_i · k̂_i) / (n − 1)    (k̂_i · k̂_i = 1; 0 if k_i = 0)

    then the mean over heads: float64 ``[n]``, zeros when ``n < 2`` (pure)."""
    k = np.asarray(keys, dtype=np.float64)
    n = k.shape[0]
    if n < 2:
        return np.zeros(n)
    norm = np.linalg.norm(k, axis=-1, keepdims=True)
    unit = np.divide(k, norm, out=np.zeros_like(k), where=norm > 0)
    total = unit.sum(axis=0)
    return (((unit * total).sum(-1) - (unit * unit).sum(-1)) / (n - 1)).mean(axis=-1)


def shift_history(bits: np.ndarray, n_queries: int, new_bits: np.ndarray) -> np.ndarray:
    """Push ``n_queries`` newer queries' bits into a uint64 history (the oldest fall off)."""
    if n_queries >= HISTORY_BITS:
        return new_bits.astype(np.uint64)
    return (bits << np.uint64(n_queries)) | np.asarray(new_bits, dtype=np.uint64)  # no copy when uint64


def unimportance_bits(probs: np.ndarray, visible: np.ndarray, n_visible: np.ndarray | None = None) -> np.ndarray:
    """History bits from the last ≤64 queries' attention rows.

    ``probs``: [q, k] attention of each query over the keys (mean over heads/layers), oldest query first.
    ``visible``: [q, k] bool, which keys each query could see (causal mask). A key a query could not see
    is not judged by that query. Bit 0 is the newest query. ``n_visible`` ``[q]``: how many keys each query
    saw in all, when ``probs`` covers only some of them (a scored range starting past slot 0; the
    threshold 1/n stays that of every key the softmax normalised over); default ``visible.sum(axis=1)``.
    """
    q = probs.shape[0]
    rows = probs[max(0, q - HISTORY_BITS) :]
    vis = visible[max(0, q - HISTORY_BITS) :]
    if n_visible is None:
        n_vis = np.maximum(vis.sum(axis=1, keepdims=True), 1)
    else:
        n_vis = np.maximum(np.asarray(n_visible)[max(0, q - HISTORY_BITS) :, None], 1)
    low = (rows < 1.0 / n_vis) & vis  # [h, k]
    weights = np.uint64(1) << np.arange(low.shape[0] - 1, -1, -1, dtype=np.uint64)  # newest -> bit 0
    return (low.astype(np.uint64) * weights[:, None]).sum(axis=0, dtype=np.uint64)


def observe(table, scores: StepScores, question_aware: bool = False) -> None:
    """Fold one step's scores into ``table``'s per-token statistics (mutates the table).

    Scores for tokens evicted since the step ran are ignored (their state is dead anyway). ``last`` and
    ``redundancy`` are cleared from ``scores.first`` on: the tokens below it (a request's protected prefix,
    which sits in the same row slots for the table's life) are never scored, so they stay 0. With
    ``question_aware`` (``VTokenConfig.question_aware``) the step that measures the observation window sets
    its keys' ``accumulated`` to the window's attention instead of adding the step's queries.
    """
    idx = np.asarray(scores.logicals, dtype=np.int64)
    if idx.size and scores.accumulated is not None:
        keep = slice(None) if idx.max() < table.seen else idx < table.seen  # the usual case: no copies
        idx = idx[keep]
        table.accumulated[idx] += np.asarray(scores.accumulated)[keep]
        table.last[scores.first : table.seen] = 0.0  # below first: never set (vtoken.core.scored_range)
        table.last[idx] = np.asarray(scores.last)[keep]
        table.unimportant[idx] = shift_history(
            table.unimportant[idx], scores.n_queries, np.asarray(scores.unimportant)[keep]
        )
        if scores.window is not None:
            table.window[idx] = np.asarray(scores.window)[keep]
            if question_aware:
                table.accumulated[idx] = table.window[idx]
        if scores.redundancy is not None:
            table.redundancy[scores.first : table.seen] = 0.0
            table.redundancy[idx] = np.asarray(scores.redundancy)[keep]
    if scores.key_norm_logicals is not None and scores.key_norm is not None:
        table.key_norm[np.asarray(scores.key_norm_logicals, dtype=np.int64)] = scores.key_norm
