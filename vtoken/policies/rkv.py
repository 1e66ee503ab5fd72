"""R-KV — redundancy-aware selection: important and not redundant."""

from dataclasses import dataclass

import numpy as np

from vtoken.policies.base import ScorerPolicy, max_pool
from vtoken.policies.context import EvictionContext, Stat
from vtoken.policies.registry import register_policy

HALF = 3  # importance max pooling, kernel 7 (as SnapKV): the live tokens within logical distance 3
LAMBDA = 0.1  # Z = λ·I − (1 − λ)·R


@register_policy("rkv")
@dataclass(frozen=True)
class RKVPolicy(ScorerPolicy):
    """Keep the tokens the last query attends to that are *not* near-copies of other live keys.

    Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Training-Free Reasoning Models Acceleration",
    2025, https://arxiv.org/abs/2505.24133. Score Z = λ·I − (1 − λ)·R, λ = 0.1 (the paper's; its code
    defaults to 0.07). Faithful: I is attention max-pooled over kernel 7; R is each key's mean cosine
    similarity to the other keys per head (``redundancy``, recomputed over the live set every scored step),
    turned into a distribution by a softmax over the request's live tokens; both terms sum to 1 per request.
    Differs: I is the *last* query's attention (the paper averages its last α = 8 queries), renormalised to
    sum 1 after pooling; one decision per token shared by all heads and layers (the paper keeps per-head
    sets), so heads and layers are averaged before the softmax; the paper zeroes each key's similarity to its
    most recent near-duplicate (cos > 0.5) so the newer copy stays — here equal scores go oldest first
    (the base class's tie rule) and nothing more; the budget, sinks and recent window are vToken's.
    """

    needs = frozenset({Stat.LAST, Stat.REDUNDANCY})

    def score(self, ctx: EvictionContext) -> np.ndarray:
        pooled = max_pool(np.asarray(ctx.last, dtype=np.float64), ctx.logical, HALF)
        mass = pooled.sum(axis=-1, keepdims=True)
        importance = np.divide(pooled, mass, out=np.zeros_like(pooled), where=mass > 0)
        r = np.asarray(ctx.redundancy, dtype=np.float64)
        e = np.exp(r - r.max(axis=-1, keepdims=True, initial=-np.inf))
        return LAMBDA * importance - (1.0 - LAMBDA) * e / e.sum(axis=-1, keepdims=True)
