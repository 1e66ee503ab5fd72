"""KV-aware request router: send a request where the KV cache has the most usable room.

Each replica publishes ``record_routing_stats()`` (``vtoken.serve.telemetry.stat_logger.routing_stats``);
Serve polls it every ``router.stats_period_s`` and hands it to every router as ``replica.routing_stats``.
Ranking::

    effective_free = free_kv_tokens
                     − fragmentation_weight · fragmentation_ratio · held_blocks · B     (wasted slots)
                     − pending · tokens_per_queued_request
    pending        = max(engine-waiting requests, router's queue length − engine-running requests)

``free_kv_tokens`` is (pool − held) · B *after* vToken reclamation, so a replica whose repacks freed
blocks ranks higher than a Naive-Evict one holding the same live tokens. The fragmentation term charges
the slots its held blocks waste (holes a packing replica would have returned; with ``repack`` they are
at most one partial block per request); it is absolute, so one short request in a mostly empty pool
costs a few slots, not a share of the pool. ``pending`` charges requests already sent there but not
yet admitted by the engine (the stats lag one poll behind a burst), plus requests this router ranked
it first for and has not sent yet: Serve runs up to 2·replicas routing tasks at once, and without
these reservations a burst all reads the same numbers and lands on one replica (measured: 22/2).

Replicas are sorted by ``effective_free``; those within ``tie_tokens`` of a rank's best share the
rank, and Serve picks the one with the shortest queue inside it (the queue-length tie-break). Replicas
with missing or stale stats (polled ``stale_after_s`` before the freshest candidate: ``stats_as_of``)
go into a last rank, and the router logs it (``ray.serve`` logger, so the
line lands in the proxy's or handle's Serve log; once per ``UNSCORED_LOG_EVERY_S`` per replica): a
replica that stops reporting is an operational fault, and a request that seems to ignore the ranking is
explained there. When no replica has fresh stats the router degrades to power-of-two-choices (two random
replicas in one rank → the shorter queue wins).
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from vtoken.serve.control.ranking import RouterParams, effective_free_tokens, rank_by_kv, stats_as_of
from vtoken.serve.telemetry.stat_logger import POLLED_AT

logger = logging.getLogger("ray.serve")
UNSCORED_LOG_EVERY_S = 30.0  # at most one "ranked last" line per replica per this many seconds


class KVAwareRouter(RequestRouter):
    """Ranks replicas by free KV capacity after vToken reclamation (see the module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        """``kwargs`` are Serve's ``request_router_kwargs``: the fields of ``RouterParams`` (documented
        there; unknown names raise). Side effect: resets this router's reservations and counters."""
        self.params = RouterParams(**kwargs)
        self._reservations: dict[str, tuple[Any, float]] = {}  # request id -> (replica id, expiry)
        self.fallbacks = 0
        self.kv_routed = 0
        self._unscored_logged: dict[Any, float] = {}  # replica id -> when its last "ranked last" was logged

    def _reserved_counts(self, now: float) -> Counter:
        reservations = getattr(self, "_reservations", {})
        for rid in [k for k, (_, expiry) in reservations.items() if expiry < now]:
            del reservations[rid]
        return Counter(replica for replica, _ in reservations.values())

    def _reserve(self, pending_request: PendingRequest | None, rank0: list[RunningReplica], now: float) -> None:
        """Record the replica Serve will most likely pick from rank 0 (shortest cached queue)."""
        if pending_request is None or not rank0 or not hasattr(self, "_reservations"):
            return
        cache = self.replica_queue_len_cache
        target = min(rank0, key=lambda r: cache.get(r.replica_id) or 0)
        self._reservations[pending_request.metadata.internal_request_id] = (
            target.replica_id,
            now + self.params.reservation_ttl_s,
        )

    def _log_unscored(self, replica: RunningReplica, params: RouterParams, now: float, as_of: float) -> None:
        """Log (rate-limited per replica) that ``replica`` has missing or stale stats and ranks last."""
        logged = getattr(self, "_unscored_logged", None)
        if logged is None or now - logged.get(replica.replica_id, float("-inf")) < UNSCORED_LOG_EVERY_S:
            return
        logged[replica.replica_id] = now
        polled = (replica.routing_stats or {}).get(POLLED_AT)
        if not isinstance(polled, (int, float)):
            why = "no routing stats"
        elif as_of - polled <= params.stale_after_s:
            why = "its routing stats lack a number the ranking needs"
        else:
            why = (
                f"stats polled {as_of - polled:.1f} s before the freshest replica's, {now - polled:.1f} s "
                f"ago (stale after {params.stale_after_s} s)"
            )
        logger.warning("vtoken router: replica %s ranked last: %s", replica.replica_id, why)

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        # From here on Serve's queue-length cache counts the request: release the reservation.
        getattr(self, "_reservations", {}).pop(pending_request.metadata.internal_request_id, None)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        params = getattr(self, "params", RouterParams())
        now = time.time()
        cache = self.replica_queue_len_cache
        if pending_request is not None:  # a retry re-ranks: do not count this request twice
            getattr(self, "_reservations", {}).pop(pending_request.metadata.internal_request_id, None)
        reserved = self._reserved_counts(now)
        as_of = stats_as_of((r.routing_stats for r in candidate_replicas), now)
        scores = [
            (
                r,
                effective_free_tokens(
                    r.routing_stats or {}, cache.get(r.replica_id), params, as_of, reserved[r.replica_id]
                ),
            )
            for r in candidate_replicas
        ]
        for replica, score in scores:
            if score is None:
                self._log_unscored(replica, params, now, as_of)
        ranks = rank_by_kv(scores, params.tie_tokens)
        if ranks is not None:
            self.kv_routed += 1
            self._reserve(pending_request, ranks[0], now)
            return ranks
        self.fallbacks += 1
        return [random.sample(list(candidate_replicas), min(2, len(candidate_replicas)))]
