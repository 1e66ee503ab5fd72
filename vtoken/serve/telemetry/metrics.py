"""Prometheus exposition of one replica: ``vtoken:*`` next to vLLM's own ``vllm:*``, names unchanged.

Each replica serves ``http://<metrics.host>:<metrics.port + local rank>/metrics`` (loopback by default)
with a plain ``prometheus_client`` HTTP server. Every sample — vLLM's, vToken's, the process
collector's — carries the labels ``application``, ``deployment`` and ``replica`` added at scrape time,
so series from different replicas never collide. We do not go through Ray's metrics export port:
it would rename everything to ``ray_vtoken_*`` / ``ray_vllm_*`` (colons are not allowed there) and
docs/architecture.md §6 keeps vLLM's names unchanged. Every ``vtoken:*`` name and help text comes from its
declaration in vtoken/metric_names.py (docs/metrics.md lists the scraped names).

Gauges and the cumulative vToken counters are read from the latest ``KVSnapshot`` when scraped (no
work per engine step); the SLA counters and latency histograms are updated once per finished request.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector

from vtoken import metric_names as names
from vtoken.core.reporting.engine_kv import KVSnapshot
from vtoken.serve.telemetry.sla import RequestLatency, SloTargets, meets_slo
from vtoken.serve.telemetry.stat_logger import StatsSink

logger = logging.getLogger(__name__)


class KVCollector(Collector):
    """The ``vtoken:*`` gauges, cumulative counters and the engine's per-request cost histograms
    (vtoken/core/reporting/request_cost.py), from ``sink.latest`` at scrape time."""

    def __init__(self, sink: StatsSink, policy: str, mode: str) -> None:
        self._sink = sink
        self._policy = policy
        self._mode = mode

    def collect(self) -> Iterable[Metric]:
        snap = self._sink.latest
        gauges = (
            (names.LIVE_TOKENS, snap.live_tokens),
            (names.HELD_BLOCKS, snap.held_blocks),
            (names.PACKING_BOUND_BLOCKS, snap.packing_bound_blocks),
            (names.NAIVE_BLOCKS, snap.naive_blocks),
            (names.POOL_BLOCKS, snap.pool_blocks),
            (names.WINDOW_BLOCKS, snap.window_blocks),
            (names.FREE_KV_TOKENS, snap.free_kv_tokens),
            (names.FRAGMENTATION_RATIO, snap.fragmentation_ratio),
            (names.KV_UTILIZATION, snap.kv_utilization),
            (names.STATS_AGE_SECONDS, max(0.0, time.time() - snap.at) if snap.at else float("nan")),
        )
        if snap.admission_limit is not None:  # SLO-aware admission on
            gauges += ((names.ADMISSION_LIMIT, snap.admission_limit),)
        for metric, value in gauges:  # each labelled by ("mode",)
            fam = GaugeMetricFamily(metric.name, metric.help, labels=list(metric.labels))
            fam.add_metric([self._mode], float(value))
            yield fam
        counter_labels = {"policy": self._policy}  # evicted_tokens': the others have none
        for metric in names.KV_COUNTERS:  # each read from the ReclaimCounters field of its bare name
            fam = CounterMetricFamily(metric.name, metric.help, labels=list(metric.labels))
            fam.add_metric([counter_labels[k] for k in metric.labels], float(getattr(snap.counters, metric.bare)))
            yield fam
        for metric, hist in snap.costs.by_metric():
            fam = HistogramMetricFamily(metric.name, metric.help)
            fam.add_metric([], [(le, float(c)) for le, c in hist.buckets()], sum_value=hist.total)
            yield fam


class LabelledView(Collector):
    """Every sample of ``sources`` with ``labels`` added (read-only view; used only for exposition)."""

    def __init__(self, sources: Iterable[CollectorRegistry], labels: dict[str, str]) -> None:
        self._sources = list(sources)
        self._labels = dict(labels)

    def collect(self) -> Iterable[Metric]:
        for source in self._sources:
            for fam in source.collect():
                out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    out.add_sample(s.name, {**s.labels, **self._labels}, s.value, s.timestamp, s.exemplar)
                yield out


def _counter(metric: names.Metric, registry: CollectorRegistry) -> Counter:
    """A label-less ``Counter`` for ``metric``, registered in ``registry`` (side effect)."""
    assert metric.kind == names.COUNTER and not metric.labels, metric
    return Counter(metric.name, metric.help, registry=registry)


def _histogram(metric: names.Metric, registry: CollectorRegistry) -> Histogram:
    """A label-less ``Histogram`` for ``metric`` with its declared buckets, registered in ``registry``."""
    assert metric.kind == names.HISTOGRAM and not metric.labels, metric
    return Histogram(metric.name, metric.help, buckets=metric.buckets, registry=registry)


class ReplicaMetrics:
    """The replica's own registry plus the exposition view (no module-level state).

    ``observe(lat)`` updates the SLA series (mutates counters); ``on_snapshot`` feeds the repack
    histogram from counter deltas (the engine reports total repack time and plan count, so each plan in
    an interval is observed at that interval's mean duration).
    """

    def __init__(
        self,
        sink: StatsSink,
        slo: SloTargets,
        policy: str,
        mode: str,
        labels: dict[str, str],
        include_process_registry: bool = True,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(KVCollector(sink, policy, mode))
        self._slo = slo
        self.requests = _counter(names.REQUESTS, self.registry)
        self.slo_met = _counter(names.SLO_MET, self.registry)
        self.ttft = _histogram(names.TTFT_SECONDS, self.registry)
        self.tpot = _histogram(names.TPOT_SECONDS, self.registry)
        self.e2e = _histogram(names.E2E_SECONDS, self.registry)
        self.repack = _histogram(names.REPACK_SECONDS, self.registry)
        self.routing_polls = _counter(names.ROUTING_STATS_POLLS, self.registry)  # the replica increments it
        sources = [self.registry] + ([REGISTRY] if include_process_registry else [])
        self.view = CollectorRegistry(auto_describe=False)
        self.view.register(LabelledView(sources, labels))
        sink.subscribe(on_finished=self.observe, on_snapshot=self._on_snapshot)

    def set_slo(self, slo: SloTargets) -> None:
        self._slo = slo

    def observe(self, lat: RequestLatency) -> None:
        self.requests.inc()
        if meets_slo(lat, self._slo):
            self.slo_met.inc()
        if lat.ttft_s is not None:
            self.ttft.observe(lat.ttft_s)
        if lat.tpot_s is not None:
            self.tpot.observe(lat.tpot_s)
        self.e2e.observe(lat.e2e_s)

    def _on_snapshot(self, previous: KVSnapshot, snap: KVSnapshot) -> None:
        plans = snap.counters.repack_plans - previous.counters.repack_plans
        if plans <= 0:
            return
        mean = max(0.0, snap.counters.repack_seconds - previous.counters.repack_seconds) / plans
        for _ in range(min(plans, 64)):
            self.repack.observe(mean)


class _TextFormatHandler(BaseHTTPRequestHandler):
    """GET /metrics → the registry in Prometheus' classic text format (0.0.4), whatever the Accept header.

    Not prometheus_client's own handler: for a scraper that prefers OpenMetrics (Prometheus does),
    prometheus_client 0.26 writes sample names with ':' replaced by '_' while keeping ':' in HELP/TYPE,
    so ``vtoken:kv_utilization`` would be stored as ``vtoken_kv_utilization``. The text format keeps the
    names exactly (checked against Prometheus 2.42 in test_serve_e2e.py).
    """

    registry: CollectorRegistry  # set on the per-server subclass

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body = generate_latest(self.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # scrapes every second: keep the replica log quiet
        pass


def _serve(registry: CollectorRegistry, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("MetricsHandler", (_TextFormatHandler,), {"registry": registry})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=f"vtoken-metrics-{port}", daemon=True).start()
    return server


def start_metrics_server(
    registry: CollectorRegistry, host: str, base_port: int, local_rank: int, span: int, wait_s: float = 10.0
):
    """Serve ``registry`` on ``host:base_port+local_rank`` (HTTP, its own thread). Returns
    ``(server, port)`` or ``(None, None)`` if every port in the span is busy.

    If the preferred port is busy (a replica being replaced may still hold it), retries it for
    ``wait_s`` seconds, then tries the next ``span`` ports. Side effect: a daemon thread per server;
    call ``server.shutdown()`` and ``server.server_close()`` to stop it.
    """
    preferred = base_port + local_rank
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _serve(registry, host, preferred), preferred
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    for port in range(base_port, base_port + local_rank + span + 1):
        if port == preferred:
            continue
        try:
            return _serve(registry, host, port), port
        except OSError:
            continue
    logger.warning("no free metrics port in %s..%s on %s", base_port, base_port + local_rank + span, host)
    return None, None
