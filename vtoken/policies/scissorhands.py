"""Scissorhands — persistence of importance."""

from dataclasses import dataclass

import numpy as np

from vtoken.policies.base import ScorerPolicy
from vtoken.policies.context import HISTORY_BITS, EvictionContext, Stat
from vtoken.policies.registry import register_policy


@register_policy("scissorhands")
@dataclass(frozen=True)
class ScissorhandsPolicy(ScorerPolicy):
    """Evict the tokens that were *unimportant* most often within the last ``history`` queries.

    A query judges a key unimportant when it gives it less than the uniform share 1/(keys it saw).
    Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache
    Compression at Test Time", NeurIPS 2023, https://arxiv.org/abs/2305.17118.
    """

    needs = frozenset({Stat.UNIMPORTANT})

    history: int = 32

    def __post_init__(self) -> None:
        if not 1 <= self.history <= HISTORY_BITS:
            raise ValueError(f"scissorhands history must be in 1..{HISTORY_BITS}, got {self.history}")

    def score(self, ctx: EvictionContext) -> np.ndarray:
        mask = np.uint64((1 << self.history) - 1)
        return -np.bitwise_count(ctx.stat(Stat.UNIMPORTANT) & mask).astype(np.float64)
