"""KNorm — key-norm eviction (query-free)."""

from dataclasses import dataclass

import numpy as np

from vtoken.policies.base import ScorerPolicy
from vtoken.policies.context import EvictionContext, Stat
from vtoken.policies.registry import register_policy


@register_policy("knorm")
@dataclass(frozen=True)
class KNormPolicy(ScorerPolicy):
    """Keys with a *low* L2 norm draw high attention: evict the largest-norm keys first.

    Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024,
    https://arxiv.org/abs/2406.11430. Norm = mean over heads and layers; needs no attention scores.
    """

    needs = frozenset({Stat.KEY_NORM})

    def score(self, ctx: EvictionContext) -> np.ndarray:
        return -np.asarray(ctx.key_norm, dtype=np.float64)
