"""H2O — Heavy-Hitter Oracle."""

from dataclasses import dataclass

import numpy as np

from vtoken.policies.base import ScorerPolicy
from vtoken.policies.context import EvictionContext, Stat
from vtoken.policies.registry import register_policy


@register_policy("h2o")
@dataclass(frozen=True)
class H2OPolicy(ScorerPolicy):
    """Keep the heavy hitters: tokens with the largest attention accumulated over every query so far.

    Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
    Models", NeurIPS 2023, https://arxiv.org/abs/2306.14048. Attention is the mean over heads and layers.
    """

    needs = frozenset({Stat.ACCUMULATED})
    attention_mass = True  # attention probabilities: keep_mass applies

    def score(self, ctx: EvictionContext) -> np.ndarray:
        return ctx.stat(Stat.ACCUMULATED)
