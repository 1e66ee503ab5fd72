"""Turning a policy's scores into victims for one request (pure: reads the table, returns positions)."""

from __future__ import annotations

import numpy as np

from vtoken.core.config import Trigger, VTokenConfig
from vtoken.core.token_table import TokenTable
from vtoken.policies.base import EvictionContext, ScorerPolicy


def eviction_count(live: int, seen: int, cfg: VTokenConfig) -> int:
    """How many tokens to evict now: down to the budget, or nothing if the trigger is not met."""
    if not cfg.mode.evicts:
        return 0
    over = live - cfg.budget.tokens(seen)
    if cfg.trigger is Trigger.BLOCK and over < cfg.block_size:
        return 0
    return max(over, 0)


def context_for(table: TokenTable, logicals: np.ndarray, salt: int) -> EvictionContext:
    return EvictionContext(
        logical=logicals,
        accumulated=table.acc[logicals],
        last=table.last[logicals],
        unimportant_bits=table.unimportant[logicals],
        key_norm=table.key_norm[logicals],
        seen=table.seen,
        salt=salt,
    )


def choose_victims(table: TokenTable, policy: ScorerPolicy, cfg: VTokenConfig, salt: int) -> np.ndarray:
    """Logical positions to evict now (ascending). Never a protected token; may be empty."""
    n = eviction_count(table.live, table.seen, cfg)
    if n == 0:
        return np.zeros(0, np.int64)
    logicals = table.live_logicals()
    evictable = table.evictable(logicals, cfg.sinks, cfg.recent)
    return policy.select(context_for(table, logicals, salt), n, evictable)
