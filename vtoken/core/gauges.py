"""The two derived KV gauges of ARCHITECTURE §6, defined once (engine stats and replica snapshots use them)."""

from __future__ import annotations


def fragmentation_ratio(live_tokens: int, held_blocks: int, block_size: int) -> float:
    """1 − live / (held · B): the share of held slots that hold no live token (0 when nothing is held)."""
    slots = held_blocks * block_size
    return 0.0 if slots <= 0 else max(0.0, 1.0 - live_tokens / slots)


def kv_utilization(held_blocks: int, pool_blocks: int) -> float:
    """held / pool, clamped to [0, 1] (0 for an empty pool)."""
    return 0.0 if pool_blocks <= 0 else min(1.0, held_blocks / pool_blocks)
