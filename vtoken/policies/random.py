"""Random eviction (seeded)."""

from dataclasses import dataclass

import numpy as np

from vtoken.policies.base import ScorerPolicy
from vtoken.policies.context import EvictionContext
from vtoken.policies.registry import register_policy

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Stateless 64-bit mixer (Steele et al. 2014): same input, same output, on every engine."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


@register_policy("random")
@dataclass(frozen=True)
class RandomPolicy(ScorerPolicy):
    """Evict uniformly at random: each token gets a fixed pseudo-random score from (seed, request, position).

    The query-free baseline of the vToken paper and of H2O (Zhang et al. 2023,
    https://arxiv.org/abs/2306.14048, "random eviction"). Stateless, so paired runs evict the same tokens.
    """

    def score(self, ctx: EvictionContext) -> np.ndarray:
        with np.errstate(over="ignore"):
            key = (np.asarray(ctx.logical, dtype=np.uint64) * _GOLDEN) ^ splitmix64(
                np.asarray(ctx.salt, dtype=np.uint64) + np.uint64(self.seed) * _GOLDEN
            )
        return (splitmix64(key) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
