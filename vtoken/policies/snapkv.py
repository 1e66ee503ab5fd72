"""SnapKV — the prompt's observation window picks the tokens to keep."""

from dataclasses import dataclass

import numpy as np

from vtoken.policies.base import ScorerPolicy, max_pool
from vtoken.policies.context import OBSERVATION_WINDOW, EvictionContext, Stat
from vtoken.policies.registry import register_policy

HALF = 3  # max pooling, kernel 7: a token and the live tokens within logical distance 3 on either side


@register_policy("snapkv")
@dataclass(frozen=True)
class SnapKVPolicy(ScorerPolicy):
    """Keep the prompt tokens its last ``OBSERVATION_WINDOW`` queries attended most, with their neighbours.

    Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024,
    https://arxiv.org/abs/2404.14469. Score = *max* pooling (kernel 7) of the window statistic over the
    live tokens within logical distance 3. The window itself (the prompt's last ``OBSERVATION_WINDOW``
    tokens) ranks above the rest of the prompt (by the same score among itself when the budget is smaller),
    and tokens generated after the prompt, which the window never saw, rank above every prompt token: kept,
    the oldest going first among themselves. Before the window is measured every token ties (oldest first).
    """

    needs = frozenset({Stat.WINDOW})
    attention_mass = True  # attention probabilities: keep_mass applies

    def score(self, ctx: EvictionContext) -> np.ndarray:
        w, pos = np.asarray(ctx.window, dtype=np.float64), np.asarray(ctx.logical)
        pooled = max_pool(w, pos, HALF)
        last = np.where(w > 0, pos, -1).max(axis=-1, keepdims=True, initial=-1)  # the prompt's last token
        top = pooled.max(axis=-1, keepdims=True, initial=0.0) + 1.0  # above every pooled score
        window = pos > last - OBSERVATION_WINDOW
        return np.where(pos > last, 2.0 * top, np.where(window, top + pooled, pooled))
