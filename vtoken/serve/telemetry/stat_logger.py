"""KV statistics of one replica, read for free from vLLM's stat-logger path.

vLLM's ``AsyncLLM`` hands every engine step's ``SchedulerStats`` (and ``IterationStats``) to each stat
logger's ``record()`` in the replica process. ``ReplicaStatLogger`` turns them into a frozen
``KVSnapshot`` and stores it in a ``StatsSink``; the router, the autoscaler and the Prometheus collector
read the sink's latest snapshot. No RPC to the engine, no engine stall: the cost is one small object
per engine step.

Where the numbers come from::

    vToken on  (vtoken.vllm.gauges.vtoken_stats_from(scheduler_stats) -> KVSnapshot, the engine's own)
        live / held / packing-bound / naive blocks, pool, evictions, repack moves and time
    vToken off (mode "none", or the integration not installed)
        held = round(kv_cache_usage · pool); live ≈ held · B (vanilla paging: no holes are tracked)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from vtoken import metric_names as names
from vtoken.core.reporting.engine_kv import KVSnapshot
from vtoken.core.reporting.request_cost import CostStats
from vtoken.serve.telemetry.sla import RequestLatency, latency_of

# Keys of record_routing_stats() / record_autoscaling_stats(): the scraped metric names, declared in
# vtoken/metric_names.py (docs/metrics.md).
FREE_KV_TOKENS = names.FREE_KV_TOKENS.name
KV_UTILIZATION = names.KV_UTILIZATION.name
FRAGMENTATION = names.FRAGMENTATION_RATIO.name
HELD_BLOCKS = names.HELD_BLOCKS.name
POOL_BLOCKS = names.POOL_BLOCKS.name
LIVE_TOKENS = names.LIVE_TOKENS.name
NUM_WAITING = names.NUM_REQUESTS_WAITING.name
NUM_RUNNING = names.NUM_REQUESTS_RUNNING.name
BLOCK_SIZE = "block_size"
POLLED_AT = "polled_at"  # wall-clock time the replica answered the poll
STATS_AGE = "stats_age_s"  # seconds since the engine step the numbers describe (0 when idle)
TRIMMED_SHARE = "trimmed_share"  # share of requests finished since the previous report that lost context


AUTOSCALING_KEYS = (KV_UTILIZATION, NUM_WAITING, NUM_RUNNING, FREE_KV_TOKENS, HELD_BLOCKS, FRAGMENTATION)


def trimmed_since(previous: CostStats, now: CostStats) -> float:
    """Share of the requests finished between two cost snapshots that lost at least one token (pure; 0 when
    none finished, or the engine restarted in between)."""
    finished = now.share.count - previous.share.count
    trimmed = now.trimmed - previous.trimmed
    return trimmed / finished if finished > 0 and trimmed >= 0 else 0.0


def routing_stats(snap: KVSnapshot, now: float) -> dict[str, float]:
    """The router's view of ``snap`` (pure). An idle engine's numbers never go stale."""
    busy = snap.num_running + snap.num_waiting > 0
    return {
        FREE_KV_TOKENS: float(snap.free_kv_tokens),
        KV_UTILIZATION: snap.kv_utilization,
        FRAGMENTATION: snap.fragmentation_ratio,
        HELD_BLOCKS: float(snap.held_blocks),
        POOL_BLOCKS: float(snap.pool_blocks),
        LIVE_TOKENS: float(snap.live_tokens),
        NUM_WAITING: float(snap.num_waiting),
        NUM_RUNNING: float(snap.num_running),
        BLOCK_SIZE: float(snap.block_size),
        POLLED_AT: now,
        STATS_AGE: max(0.0, now - snap.at) if busy and snap.at else 0.0,
    }


def snapshot_from(
    scheduler_stats: Any,
    pool_blocks: int,
    block_size: int,
    vtoken_reader: Callable[[Any], Any] | None = None,
    admission_reader: Callable[[Any], int | None] | None = None,
) -> KVSnapshot:
    """Build a snapshot from one ``SchedulerStats`` (pure). ``vtoken_reader`` is
    ``vtoken.vllm.gauges.vtoken_stats_from`` when available; it returns None when vToken is off.
    ``admission_reader`` (``vtoken.vllm.gauges.admission_limit_from``) fills ``admission_limit`` in any mode."""
    running = int(getattr(scheduler_stats, "num_running_reqs", 0))
    waiting = int(getattr(scheduler_stats, "num_waiting_reqs", 0))
    limit = admission_reader(scheduler_stats) if admission_reader is not None else None
    vt = vtoken_reader(scheduler_stats) if vtoken_reader is not None else None
    if vt is not None:
        return replace(vt, num_running=running, num_waiting=waiting, admission_limit=limit)
    held = int(round(float(getattr(scheduler_stats, "kv_cache_usage", 0.0)) * pool_blocks))
    return KVSnapshot(
        admission_limit=limit,
        live_tokens=held * block_size,
        held_blocks=held,
        packing_bound_blocks=held,
        naive_blocks=held,
        pool_blocks=pool_blocks,
        block_size=block_size,
        num_running=running,
        num_waiting=waiting,
    )


class StatsSink:
    """Latest ``KVSnapshot`` plus finished-request latencies of one replica (thread-safe).

    Written by ``ReplicaStatLogger.record`` (vLLM's output-handler task), read by the replica's
    ``record_routing_stats``/``record_autoscaling_stats`` and the metrics collector (any thread).
    ``on_finished`` callbacks run inline in ``record`` and must be cheap.
    """

    def __init__(self, pool_blocks: int = 0, block_size: int = 32) -> None:
        self._lock = threading.Lock()
        self._latest = KVSnapshot(pool_blocks=pool_blocks, block_size=block_size, at=0.0)
        self._on_finished: list[Callable[[RequestLatency], None]] = []
        self._on_snapshot: list[Callable[[KVSnapshot, KVSnapshot], None]] = []

    @property
    def latest(self) -> KVSnapshot:
        with self._lock:
            return self._latest

    def subscribe(
        self,
        on_finished: Callable[[RequestLatency], None] | None = None,
        on_snapshot: Callable[[KVSnapshot, KVSnapshot], None] | None = None,
    ) -> None:
        """Register callbacks (mutates the sink): per finished request; per (previous, new) snapshot."""
        if on_finished is not None:
            self._on_finished.append(on_finished)
        if on_snapshot is not None:
            self._on_snapshot.append(on_snapshot)

    def put(self, snap: KVSnapshot) -> None:
        """Replace the latest snapshot (mutates the sink) and notify ``on_snapshot`` subscribers."""
        with self._lock:
            previous, self._latest = self._latest, snap
        for callback in self._on_snapshot:
            callback(previous, snap)

    def finished(self, latency: RequestLatency) -> None:
        for callback in self._on_finished:
            callback(latency)


def make_stat_logger_class(sink: StatsSink) -> type:
    """A ``StatLoggerBase`` subclass bound to ``sink`` (vLLM instantiates it as ``cls(vllm_config, idx)``).

    A class, not a closure over a module global: each replica builds its own. Importing vLLM here keeps
    this module importable without vLLM (router/autoscaler unit tests).
    """
    from vllm.v1.metrics.loggers import StatLoggerBase

    try:
        from vtoken.vllm.gauges import admission_limit_from as admission
        from vtoken.vllm.gauges import vtoken_stats_from as reader
    except ImportError:  # the vLLM integration is not installed: vanilla accounting
        reader = admission = None

    class ReplicaStatLogger(StatLoggerBase):
        """Feeds ``sink`` from every engine step; cheap (no engine call)."""

        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            self._cache = vllm_config.cache_config
            self._engine_index = engine_index

        def _pool(self) -> int:
            # vLLM keeps one null block out of the pool (docs/architecture.md §4, invariant 2).
            return max(0, int(self._cache.num_gpu_blocks or 0) - 1)

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                sink.put(snapshot_from(scheduler_stats, self._pool(), int(self._cache.block_size), reader, admission))
            if iteration_stats is not None:
                for fin in iteration_stats.finished_requests:
                    sink.finished(latency_of(fin))

        def log_engine_initialized(self) -> None:
            sink.put(KVSnapshot(pool_blocks=self._pool(), block_size=int(self._cache.block_size)))

    return ReplicaStatLogger
