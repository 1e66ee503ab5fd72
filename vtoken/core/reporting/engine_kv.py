"""KV statistics of one engine, declared once: the engine reports them, the replica forwards them, the
router, the autoscaler and the Prometheus exporter read them (docs/architecture.md §6).

``ReclaimCounters`` are monotonic totals kept by whoever owns the blocks (the engine-free
``CacheManager``, the vLLM scheduler). ``KVSnapshot`` is one engine's state at the end of a step: gauges
summed over requests, those counters, and the two derived gauges ``fragmentation_ratio`` and
``kv_utilization`` (defined here and nowhere else). Both are frozen: an update builds a new object.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace

from vtoken.core.reporting.request_cost import CostStats


def fragmentation_ratio(live_tokens: int, held_blocks: int, block_size: int) -> float:
    """1 − live / (held · B): the share of held slots that hold no live token (0 when nothing is held)."""
    slots = held_blocks * block_size
    return 0.0 if slots <= 0 else max(0.0, 1.0 - live_tokens / slots)


def kv_utilization(held_blocks: int, pool_blocks: int) -> float:
    """held / pool, clamped to [0, 1] (0 for an empty pool)."""
    return 0.0 if pool_blocks <= 0 else min(1.0, held_blocks / pool_blocks)


@dataclass(frozen=True)
class ReclaimCounters:
    """Monotonic totals since the engine started (frozen; ``add`` returns the updated copy).

    ``evicted_tokens``: tokens the policy evicted. ``reclaimed_blocks``: blocks returned to the pool by
    repack plans. ``repack_moves``: KV slot copies. ``repack_seconds``: worker time spent copying.
    ``repack_plans``: plans executed. ``preemptions``: requests whose table was dropped by a preemption.
    ``carried_reservations``: reuse+repack steps whose pre-placed decode slot waited for vLLM to schedule.
    ``cow_blocks``: prefix-cached (or shared) blocks a step would have written that got a replacement block
    instead and went back to vLLM's pool still cached (copy on write, vtoken/core/cow.py). ``cow_moves``: the
    slot copies that took (their live tokens; also counted in ``repack_moves``). ``cow_fallbacks``: cached
    blocks un-hashed and rewritten in place because no replacement block was free.
    ``invariant_checks`` / ``invariant_violations`` / ``invariant_seconds``: KV invariant checks run, the
    violations they found, and the time they took (vtoken/vllm/scheduling/invariants.py).
    ``pressure_rounds`` / ``pressure_evicted_tokens`` / ``pressure_at_floor``: ``trigger: pressure``'s
    schedule() calls that found the pool short, the tokens those rounds took (also in ``evicted_tokens``),
    and the rounds that could not make the step fit with every request at its floor
    (vtoken/vllm/scheduling/pressure.py).
    """

    evicted_tokens: int = 0
    reclaimed_blocks: int = 0
    repack_moves: int = 0
    repack_seconds: float = 0.0
    repack_plans: int = 0
    preemptions: int = 0
    carried_reservations: int = 0
    cow_blocks: int = 0
    cow_moves: int = 0
    cow_fallbacks: int = 0
    invariant_checks: int = 0
    invariant_violations: int = 0
    invariant_seconds: float = 0.0
    pressure_rounds: int = 0
    pressure_evicted_tokens: int = 0
    pressure_at_floor: int = 0

    def add(self, **deltas: float) -> ReclaimCounters:
        """A copy with ``deltas`` added (pure); an unknown name raises ``TypeError``."""
        return replace(self, **{k: getattr(self, k) + v for k, v in deltas.items()})

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class KVSnapshot:
    """One engine's KV state at the end of a scheduling step (block counts exclude vLLM's null block).

    Gauges: ``live_tokens`` (Σ live tokens over requests), ``held_blocks`` (blocks they hold),
    ``packing_bound_blocks`` (Σ ⌈live/B⌉), ``naive_blocks`` (what the paired Naive-Evict accounting would
    hold), ``pool_blocks`` (usable blocks), ``block_size``, ``num_requests`` (with a token table),
    ``window_blocks`` (blocks held in the sliding-window KV cache groups of a hybrid model: vLLM's, never
    evicted by vToken; 0 on other models). ``live_tokens``, ``held_blocks``, ``packing_bound_blocks`` and
    ``naive_blocks`` describe the one group vToken manages; ``free_blocks`` and ``kv_utilization`` the whole
    pool (its window blocks counted as taken).
    ``num_running`` / ``num_waiting``: vLLM's scheduler queues (filled in by the replica).
    ``source``: ``"vtoken"`` when the numbers come from vToken's accounting, ``"vllm"`` when estimated from
    vLLM's ``kv_cache_usage`` (vToken off). ``at``: wall-clock time of the step (0: never stepped).
    ``admission_limit``: the running-batch limit SLO-aware admission holds the engine to (``None``: admission
    off; reported in every mode, also ``none``).
    """

    live_tokens: int = 0
    held_blocks: int = 0
    packing_bound_blocks: int = 0
    naive_blocks: int = 0
    pool_blocks: int = 0
    block_size: int = 32
    num_requests: int = 0
    window_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    counters: ReclaimCounters = field(default_factory=ReclaimCounters)
    policy: str = ""
    mode: str = ""
    source: str = "vllm"
    at: float = field(default_factory=time.time)
    admission_limit: int | None = None
    costs: CostStats = field(
        default_factory=CostStats
    )  # finished requests' costs (vtoken/core/reporting/request_cost.py)

    @property
    def free_blocks(self) -> int:
        return max(0, self.pool_blocks - self.held_blocks - self.window_blocks)

    @property
    def free_kv_tokens(self) -> int:
        """Slots a new request can get right now (after vToken reclamation): free blocks · B."""
        return self.free_blocks * self.block_size

    @property
    def fragmentation_ratio(self) -> float:
        """1 − live / (held · B): the share of held slots that hold no live token."""
        return fragmentation_ratio(self.live_tokens, self.held_blocks, self.block_size)

    @property
    def kv_utilization(self) -> float:
        """(held + window) / pool, in [0, 1]."""
        return kv_utilization(self.held_blocks + self.window_blocks, self.pool_blocks)
