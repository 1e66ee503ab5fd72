"""One request's eviction decision, in the order every engine follows (docs/architecture.md §2).

``decide_step`` is the single definition of the step order; the engine-free ``CacheManager`` and the vLLM
scheduler both call it and differ only in what they do with blocks afterwards::

    victims = choose_victims(table, policy, cfg, salt)   policy + budget + protection     (pure;
                                                           whole original blocks with granularity=block)
    table.evict(victims)                                   holes appear
    [reuse+repack, one new token] table.place(1)           the new token takes the lowest hole
    plan = table.plan(); table.apply(plan)                 minimal moves; the row is dense again
    → the caller copies plan.moves and keeps the row's first plan.keep_blocks blocks
    [other modes] the step's new tokens are placed after, appended at ``live``
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vtoken.core.config import Granularity, Trigger, VTokenConfig
from vtoken.core.token_table import SlotPlan, TokenTable
from vtoken.policies.base import ScorerPolicy
from vtoken.policies.context import EvictionContext


def eviction_count(live: int, seen: int, prompt_len: int, cfg: VTokenConfig) -> int:
    """How many tokens to evict now: down to the budget (``VTokenConfig.kept_live``), or nothing if the
    trigger is not met."""
    if not cfg.mode.evicts or cfg.trigger is Trigger.PRESSURE:  # pressure: the budget is a floor only
        return 0
    over = live - cfg.kept_live(seen, prompt_len)
    if cfg.trigger is Trigger.BLOCK and over < cfg.block_size:
        return 0
    return max(over, 0)


def context_for(table: TokenTable, logicals: np.ndarray, salt: int, policy: ScorerPolicy) -> EvictionContext:
    """The policy's view of ``logicals``: the statistics it ``needs`` (the others stay None)."""
    stats = {stat.value: table.stat(stat)[logicals] for stat in policy.needs}
    return EvictionContext(logical=logicals, seen=table.seen, salt=salt, **stats)


def choose_victims(table: TokenTable, policy: ScorerPolicy, cfg: VTokenConfig, salt: int) -> np.ndarray:
    """Logical positions to evict now (ascending). Never a protected token; may be empty. Pure.

    ``granularity=block``: ``⌈n/B⌉`` whole original blocks instead (``ScorerPolicy.select_blocks``).
    ``keep_mass``: at least as many as keep that share of the evictable tokens' attention mass (the same
    trigger rule: with trigger ``block`` only once a block's worth is due)."""
    n = eviction_count(table.live, table.seen, table.prompt_len, cfg)
    if n == 0 and (cfg.keep_mass is None or not cfg.mode.evicts):
        return np.zeros(0, np.int64)
    logicals = table.live_logicals()
    evictable = table.evictable(logicals, cfg.sinks, cfg.recent, cfg.kept_prompt(table.prompt_len))
    ctx = context_for(table, logicals, salt, policy)
    if cfg.keep_mass is not None:
        by_mass = policy.mass_evictions(ctx, evictable, cfg.keep_mass)
        if cfg.trigger is not Trigger.BLOCK or by_mass >= cfg.block_size:
            n = max(n, by_mass)
        if n == 0:
            return np.zeros(0, np.int64)
    if cfg.granularity is Granularity.BLOCK:
        return policy.select_blocks(ctx, n, evictable, cfg.block_size)
    return policy.select(ctx, n, evictable)


@dataclass(frozen=True)
class StepDecision:
    """What ``decide_step`` did to one request's table (read-only record for the block owner)."""

    victims: np.ndarray  # int64 logical positions evicted (ascending; may be empty)
    placed: np.ndarray | None  # reuse+repack: row slot(s) the step's new token took before the plan
    plan: SlotPlan  # already applied to the table: copy its moves, keep its first keep_blocks blocks

    def written_blocks(self, keep: int) -> np.ndarray:
        """Row blocks below ``keep`` this step writes (ascending, pure): those holding a move destination or
        the placed token's hole, and every kept block from the live frontier on (later tokens append there;
        with ``naive`` accounting the row keeps blocks past it). A block that must not be written (a prefix-
        cached or shared one) among them is replaced by a copy (``vtoken.core.cow``)."""
        B = self.plan.block_size
        parts = [np.arange(self.plan.live // B, keep, dtype=np.int64)]
        if self.plan.num_moves:
            parts.append(self.plan.moves[:, 1] // B)
        if self.placed is not None:
            parts.append(np.asarray(self.placed, np.int64) // B)
        blocks = np.unique(np.concatenate(parts))
        return blocks[blocks < keep]


def decide_step(
    table: TokenTable,
    policy: ScorerPolicy,
    cfg: VTokenConfig,
    salt: int,
    n_new: int,
    victims: np.ndarray | None = None,
) -> StepDecision:
    """Evict down to the budget, place a lone new token into a hole (reuse+repack), plan and apply the
    repack. Mutates ``table``; ``n_new`` is the number of tokens this step will compute (the caller places
    them afterwards unless ``placed`` is set). Without victims the row is already dense: nothing is placed
    and the plan is empty. ``victims``: evict exactly these (ascending, evictable logical positions) instead
    of the budget's choice: the batch-wide decision of ``trigger: pressure`` (``vtoken.core.batch.pressure``);
    the rest of the step order is the same."""
    if victims is None:
        victims = choose_victims(table, policy, cfg, salt)
    if victims.size:
        table.evict(victims, cfg.sinks, cfg.recent, cfg.kept_prompt(table.prompt_len))
    placed = table.place(1) if victims.size and cfg.mode.reuses_holes and n_new == 1 else None
    plan = table.plan()
    table.apply(plan)
    return StepDecision(victims=victims, placed=placed, plan=plan)
