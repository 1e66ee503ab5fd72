"""Eviction policies: a policy only *scores*; the base class owns selection.

Selection rules, shared by every policy and by every engine (token table, fast simulator, vLLM):
  * only *evictable* tokens are candidates (not a sink, not in the recent window, not in a shared
    prefix block — the caller passes that mask);
  * the lowest scores are evicted first; ties go to the older token (lower logical position);
  * scores must be finite.

Adaptive budget (``mass_evictions``, ``keep_mass`` τ): for a policy whose score is an attention mass
(``attention_mass``), how many of the lowest-scored evictable tokens can go while the kept evictable ones
still hold ≥ τ of their total score.

Span pooling (``pool`` = ``VTokenConfig.score_pool``, 0: off): every selection ranks a token by the highest
score among the live tokens within logical distance ``pool`` (``max_pool``), so a token that scores high keeps
its neighbours and a value spread over several tokens (a number's digits) is kept or evicted together::

    pool 1     logical   0    1    2    3    4    5
               score    .01  .02  .90  .01  .03  .02
               ranked   .02  .90  .90  .90  .03  .03     the tokens beside the heavy hitter rank with it

Block granularity (``select_blocks``, the block-level baseline): whole original blocks instead of tokens;
a block is a candidate only if all its tokens are live and evictable, blocks go by their tokens' mean score.

One decision per token per request, shared by all layers and heads: statistics are the mean over
heads and layers of each key's attention probability (``vtoken.policies.context``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from vtoken.policies.context import ATTENTION_STATS, EvictionContext, Stat


@dataclass(frozen=True)
class ScorerPolicy:
    """Base of every policy. Subclasses implement ``score`` only (higher = keep); selection ranks by
    ``ranked`` (``score``, max-pooled over ``pool`` neighbours each side when ``pool`` > 0).

    ``needs`` names the statistics ``score()`` reads (``Stat`` members; engines measure and pass only
    those). It is checked when the subclass is defined: an unknown name fails at import, not at run time.
    """

    name: ClassVar[str] = "base"
    needs: ClassVar[frozenset[Stat]] = frozenset()
    attention_mass: ClassVar[bool] = False  # score() is non-negative attention that adds up (keep_mass applies)
    seed: int = 0
    pool: int = 0  # span pooling: rank by the max score within this logical distance (0: off)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        valid = {s.value for s in Stat}
        unknown = sorted(str(n) for n in cls.needs if str(n) not in valid)
        if unknown:
            raise TypeError(f"{cls.__name__}.needs names unknown statistics {unknown}; valid: {sorted(valid)}")
        cls.needs = frozenset(Stat(n) for n in cls.needs)

    @classmethod
    def needs_attention(cls) -> bool:
        """False for query-free policies: no attention scores need collecting."""
        return bool(cls.needs & ATTENTION_STATS)

    def score(self, ctx: EvictionContext) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement score()")

    def select(self, ctx: EvictionContext, n_evict: int, evictable: np.ndarray) -> np.ndarray:
        """Logical positions of the ``n_evict`` lowest-scoring evictable tokens (1-D context).

        Pure: does not touch the table. Returns fewer when fewer tokens are evictable.
        """
        if n_evict <= 0:
            return np.zeros(0, np.int64)
        scores = self._finite_scores(ctx, evictable)
        cand = np.flatnonzero(evictable)
        order = np.lexsort((ctx.logical[cand], scores[cand]))
        return np.sort(ctx.logical[cand[order[:n_evict]]])

    def mass_evictions(self, ctx: EvictionContext, evictable: np.ndarray, keep_mass: float) -> int:
        """How many evictable tokens to evict (lowest scores first, as ``select`` picks them) so that the
        kept evictable tokens hold at least ``keep_mass`` of the evictable tokens' score mass (1-D context;
        pure). The largest ``n`` with the ``n`` lowest scores summing to ≤ ``(1 − keep_mass)`` of the total::

            scores (evictable)   0.01 0.02 0.05 0.12 0.80     total 1.00, keep_mass 0.9
            lowest-first sums    0.01 0.03 0.08 0.20 1.00     ≤ 0.10: three tokens go, 0.92 is kept
        """
        if not self.attention_mass:
            raise TypeError(f"policy {self.name!r} does not score attention mass; keep_mass needs one that does")
        if self.pool:
            raise TypeError("keep_mass sums attention mass; pooled scores do not add up (score_pool must be 0)")
        scores = np.sort(self._finite_scores(ctx, evictable)[evictable])
        if scores.size and scores[0] < 0:
            raise ValueError(f"policy {self.name!r} returned a negative attention mass")
        return int(np.count_nonzero(np.cumsum(scores) <= (1.0 - keep_mass) * scores.sum()))

    def select_blocks(self, ctx: EvictionContext, n_evict: int, evictable: np.ndarray, block_size: int) -> np.ndarray:
        """Block granularity (1-D context): logical positions of whole original blocks ``b·B .. b·B+B-1``.

        A block is a candidate only if all its ``B`` tokens are in ``ctx`` (live) and evictable (no sink, no
        recent token, not shared; a partly filled or partly evicted block never is). Blocks go lowest mean
        score first, ties to the older block. Rounding rule: ``⌈n_evict / B⌉`` blocks (fewer if fewer
        qualify), so the request ends up to ``B − 1`` tokens *below* its budget. Pure.
        """
        if n_evict <= 0:
            return np.zeros(0, np.int64)
        scores = self._finite_scores(ctx, evictable)
        blocks = np.asarray(ctx.logical)[evictable] // block_size
        count = np.bincount(blocks)
        ids = np.flatnonzero(count == block_size)
        mean = np.bincount(blocks, weights=scores[evictable])[ids] / block_size
        chosen = np.sort(ids[np.lexsort((ids, mean))[: -(-n_evict // block_size)]])
        return (chosen[:, None] * block_size + np.arange(block_size)).ravel().astype(np.int64)

    def ranked(self, ctx: EvictionContext) -> np.ndarray:
        """What selection ranks by (float64, aligned with ``ctx.logical``): ``score``, max-pooled over the
        live tokens within logical distance ``pool`` when ``pool`` > 0. Pure."""
        scores = np.asarray(self.score(ctx), dtype=np.float64)
        return max_pool(scores, ctx.logical, self.pool) if self.pool else scores

    def _finite_scores(self, ctx: EvictionContext, evictable: np.ndarray) -> np.ndarray:
        scores = self.ranked(ctx)
        if not np.all(np.isfinite(scores[evictable])):
            raise ValueError(f"policy {self.name!r} returned non-finite scores")
        return scores

    def select_batch(self, ctx: EvictionContext, n_evict: np.ndarray, evictable: np.ndarray) -> np.ndarray:
        """Batched ``select`` for 2-D contexts whose rows are in ascending logical order.

        Returns a bool mask ``[R, C]`` of victims; row r has ``min(n_evict[r], evictable in r)`` set.
        Same order as ``select`` (score, then logical position).
        """
        victims = np.zeros(evictable.shape, dtype=bool)
        k_max = int(n_evict.max(initial=0))
        if k_max <= 0:
            return victims
        raw = self.ranked(ctx)
        if not np.isfinite(raw).all():
            raise ValueError(f"policy {self.name!r} returned non-finite scores")
        scores = np.where(evictable, raw, np.inf)
        n = np.minimum(n_evict, evictable.sum(axis=1))
        rows = np.arange(scores.shape[0])
        if k_max <= 4:  # the common decode case: a few argmin rounds beat a sort
            for j in range(k_max):
                pick = np.argmin(scores, axis=1)  # first minimum = lowest logical among ties
                take = n > j
                victims[rows[take], pick[take]] = True
                scores[rows[take], pick[take]] = np.inf
            return victims
        if np.any(n_evict != k_max):  # uneven requests: a stable sort per row
            order = np.argsort(scores, axis=1, kind="stable")[:, :k_max]
            take = np.arange(k_max)[None, :] < n[:, None]
            victims[np.broadcast_to(rows[:, None], order.shape)[take], order[take]] = True
            return victims
        # the k-th smallest score per row, then everything below it and the oldest of its ties (O(n))
        kk = min(k_max, scores.shape[1])
        kth = np.partition(scores, kk - 1, axis=1)[:, kk - 1 : kk]
        below = scores < kth
        ties = (scores == kth) & np.isfinite(scores)
        room = n[:, None] - below.sum(axis=1, keepdims=True)
        return below | (ties & (np.cumsum(ties, axis=1) <= room))


def max_pool(scores: np.ndarray, logical: np.ndarray, half: int) -> np.ndarray:
    """Each entry's maximum over the entries whose logical position is within ``half`` of its own (itself
    included), along the last axis; ``logical`` ascends along it (1-D, or 2-D rows). A neighbour that was
    evicted is simply absent, so the window never reaches past ``half`` logical positions. Pure."""
    w, pos = np.asarray(scores, dtype=np.float64), np.asarray(logical)
    pooled = w.copy()
    for k in range(1, half + 1):  # logicals ascend: a neighbour within distance half is within half entries
        near = pos[..., k:] - pos[..., :-k] <= half
        np.maximum(pooled[..., k:], np.where(near, w[..., :-k], -np.inf), out=pooled[..., k:])
        np.maximum(pooled[..., :-k], np.where(near, w[..., k:], -np.inf), out=pooled[..., :-k])
    return pooled
