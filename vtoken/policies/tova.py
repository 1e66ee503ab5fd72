"""TOVA — token omission via attention."""

from dataclasses import dataclass

import numpy as np

from vtoken.policies.base import ScorerPolicy
from vtoken.policies.context import EvictionContext, Stat
from vtoken.policies.registry import register_policy


@register_policy("tova")
@dataclass(frozen=True)
class TOVAPolicy(ScorerPolicy):
    """Evict the token the *last* query attended least (mean over heads and layers).

    Oren et al., "Transformers are Multi-State RNNs", 2024, https://arxiv.org/abs/2401.06104.
    """

    needs = frozenset({Stat.LAST})
    attention_mass = True  # attention probabilities: keep_mass applies

    def score(self, ctx: EvictionContext) -> np.ndarray:
        return ctx.stat(Stat.LAST)
