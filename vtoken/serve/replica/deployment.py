"""The Serve replica: vLLM's ``AsyncLLM`` (multiprocess engine, as in ``vllm serve``) with vToken on,
vLLM's OpenAI app as the ASGI ingress, KV stats for the router and the autoscaler, Prometheus metrics.

::

    Serve proxy ─HTTP─▶ VTokenReplica (this actor)                       EngineCore proc ─ Worker proc
                        RequestGuard → vLLM FastAPI app → AsyncLLM ═ZMQ═▶ scheduler (+ vToken)
                        ReplicaStatLogger ◀── SchedulerStats/IterationStats every step
                          └▶ StatsSink ─▶ record_routing_stats()      (router, every stats_period_s)
                                       ─▶ record_autoscaling_stats()  (controller, metrics_interval_s)
                                       ─▶ /metrics on metrics.port + local rank (Prometheus)
                        MetricsRegistry (head) ◀── register(endpoint) every 2 s (telemetry/discovery.py)

Every response names its replica and node (``x-vtoken-replica``, ``x-vtoken-node`` = the Ray node id);
every metric sample carries the same ``replica`` and ``node`` labels.

The deployment options (replicas, autoscaling, router) are attached in ``vtoken.serve.launch.app``; this
module is only the class. The engine class is injectable (``engine_factory``) so a test can pass a
different real engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import ray
from ray import serve

from vtoken.serve.config import ServeAppConfig
from vtoken.serve.replica.cost_field import CostBook, recording
from vtoken.serve.telemetry.discovery import HEARTBEAT_S, ensure_registry, target_address
from vtoken.serve.telemetry.sla import SloTargets
from vtoken.serve.telemetry.stat_logger import (
    AUTOSCALING_KEYS,
    POLLED_AT,
    TRIMMED_SHARE,
    StatsSink,
    make_stat_logger_class,
    routing_stats,
    trimmed_since,
)

logger = logging.getLogger("ray.serve")

FAULT_FILE_ENV = "VTOKEN_FAULT_FILE"


class VTokenReplica:
    """One model replica.

    Chaos hook (tests only): if ``$VTOKEN_FAULT_FILE`` names a file holding
    ``{"stats_fault": {"ranks": [1], "mode": "stale" | "missing"}}``, the replicas of those ranks report
    stale (polled an hour ago) or no routing stats. Read at most once per poll, only when set.
    """

    async def __init__(self, cfg: ServeAppConfig, engine_factory: Callable[..., Any] | None = None) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from vtoken.serve.replica.engine import (
            bind_cpus,
            engine_args,
            engine_exits_with_replica,
            refusal_reported,
            resolve_model_path,
        )
        from vtoken.serve.replica.openai_app import RequestGuard, build_vllm_app
        from vtoken.serve.telemetry.metrics import ReplicaMetrics, start_metrics_server

        self._engine = None
        self._metrics_server = None
        self._sd_task: asyncio.Task | None = None
        self._registry = None
        self.cfg = cfg
        ctx = serve.get_replica_context()
        rank = getattr(ctx, "rank", 0)
        self._rank = int(getattr(rank, "rank", rank) or 0)
        self._local_rank = int(getattr(rank, "local_rank", self._rank) or 0)
        self._replica_id = ctx.replica_id.unique_id
        self._node_id = ray.get_runtime_context().get_node_id()
        self._fault_file = os.environ.get(FAULT_FILE_ENV) or None
        self._fault: tuple[float, dict[str, Any]] = (0.0, {})
        binding = bind_cpus(cfg, self._local_rank)
        engine_exits_with_replica()  # no orphaned VLLM::EngineCore / Worker if this process is killed
        # may convert/build the checkpoint on first use (~35 s for the default model): off the event loop
        model_path = await asyncio.to_thread(resolve_model_path, cfg.model)

        self._sink = StatsSink(block_size=cfg.vtoken.block_size)
        self._reported_costs = self._sink.latest.costs  # the costs at the previous autoscaling report
        labels = {
            "application": ctx.app_name or "",
            "deployment": ctx.deployment,
            "replica": self._replica_id,
            "node": self._node_id,
        }
        self._metrics = ReplicaMetrics(
            self._sink,
            SloTargets.from_ms(cfg.slo.ttft_ms, cfg.slo.tpot_ms),
            cfg.vtoken.policy,
            cfg.vtoken.mode,
            labels,
        )
        started = time.monotonic()
        factory = engine_factory or AsyncLLM.from_engine_args
        with refusal_reported():  # a vToken refusal fails this constructor with its own message
            self._engine = factory(
                AsyncEngineArgs(**engine_args(cfg, model_path)), stat_loggers=[make_stat_logger_class(self._sink)]
            )
        api_key = cfg.limits.resolved_api_key()
        costs = CostBook()  # each finished request's eviction cost, for its response (cost_field.py)
        self._engine.generate = recording(self._engine.generate, costs)  # this instance only
        vllm_app = await build_vllm_app(self._engine, cfg, model_path)
        self._asgi = RequestGuard(
            vllm_app,
            cfg,
            api_key,
            {"x-vtoken-replica": self._replica_id, "x-vtoken-rank": str(self._rank), "x-vtoken-node": self._node_id},
            self._ready_info,
            costs,
        )
        if cfg.metrics.port is not None:
            self._metrics_server, self.metrics_port = start_metrics_server(
                self._metrics.view,
                cfg.metrics.host,
                cfg.metrics.port,
                self._local_rank,
                cfg.metrics.port_span,
                cfg.metrics.port_wait_s,
            )
        else:
            self.metrics_port = None
        if self.metrics_port is not None and cfg.metrics.discovery:
            target = target_address(cfg.metrics.host, ray.util.get_node_ip_address(), self.metrics_port)
            self._sd_task = asyncio.get_running_loop().create_task(self._register_endpoint(target, labels))
        logger.info(
            "vToken replica %s (rank %d, cpus %s) ready in %.1f s; model %s, mode %s, metrics port %s",
            self._replica_id,
            self._rank,
            binding,
            time.monotonic() - started,
            cfg.model_name,
            cfg.vtoken.mode,
            self.metrics_port,
        )

    async def _register_endpoint(self, target: str, labels: dict[str, str]) -> None:
        """Heartbeat this replica's metrics endpoint to the cluster's registry (re-created if it died)."""
        registry, warned = None, False
        while True:
            try:
                registry = registry or ensure_registry(self.cfg.metrics.sd_file)
                ref = registry.register.remote(self._replica_id, target, labels)
                await asyncio.wait_for(ref, 2 * HEARTBEAT_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - discovery must never take the replica down
                registry = None
                if not warned:
                    logger.warning("metrics discovery: cannot register %s: %s", target, exc)
                    warned = True
            self._registry = registry
            await asyncio.sleep(HEARTBEAT_S)

    async def __serve_build_asgi_app__(self):
        # Serve calls this once after __init__; the returned ASGI app is the replica's ingress.
        return self._asgi

    def _faulty(self) -> str | None:
        """The injected stats fault for this replica's rank, if any (re-reads the file when it changed)."""
        if self._fault_file is None:
            return None
        try:
            mtime = os.stat(self._fault_file).st_mtime
            if mtime != self._fault[0]:
                with open(self._fault_file) as f:
                    self._fault = (mtime, dict(json.load(f).get("stats_fault") or {}))
        except (OSError, ValueError):
            self._fault = (0.0, {})
        fault = self._fault[1]
        if fault and self._rank in set(fault.get("ranks", [])):
            return str(fault.get("mode", "stale"))
        return None

    def record_routing_stats(self) -> dict[str, float]:
        """Called by Serve every ``router.stats_period_s``; reads the latest snapshot (no engine call)."""
        stats = routing_stats(self._sink.latest, time.time())
        self._metrics.routing_polls.inc()
        fault = self._faulty()
        if fault == "missing":
            return {}
        if fault == "stale":
            stats[POLLED_AT] -= 3600.0
        return stats

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Called by Serve every ``autoscaling.metrics_interval_s``; numbers only (Serve drops others).
        The policy uses ``vtoken:kv_utilization``, ``vllm:num_requests_waiting`` and ``trimmed_share`` (share
        of the requests finished since the previous report that lost context; mutates that mark); the rest
        is there for custom policies (Serve averages each over ``look_back_period_s``)."""
        snap = self._sink.latest
        stats = routing_stats(snap, time.time())
        previous, self._reported_costs = self._reported_costs, snap.costs
        return {**{key: stats[key] for key in AUTOSCALING_KEYS}, TRIMMED_SHARE: trimmed_since(previous, snap.costs)}

    def _ready_info(self) -> dict[str, Any]:
        snap = self._sink.latest
        return {
            "status": "ready",
            "replica": self._replica_id,
            "rank": self._rank,
            "node": self._node_id,
            "model": self.cfg.model_name,
            "mode": self.cfg.vtoken.mode,
            "policy": self.cfg.vtoken.policy,
            "metrics_port": self.metrics_port,
            **routing_stats(snap, time.time()),
        }

    async def check_health(self) -> None:
        """Serve's health probe: raises if the engine died (Serve then replaces the replica)."""
        if self._engine is None:
            raise RuntimeError("engine not started")
        await self._engine.check_health()

    def __del__(self) -> None:
        # Serve drops the replica on shutdown/scale-down/health failure: stop the engine processes and
        # the metrics thread so no child process or port outlives the actor.
        if getattr(self, "_sd_task", None) is not None:
            self._sd_task.cancel()
            with contextlib.suppress(Exception):  # no registry (yet), or Ray is shutting down
                self._registry.unregister.remote(self._replica_id)
            self._sd_task = None
        if getattr(self, "_metrics_server", None) is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        if getattr(self, "_engine", None) is not None:
            try:
                self._engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")
            self._engine = None
