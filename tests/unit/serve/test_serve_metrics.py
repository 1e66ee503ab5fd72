"""KV snapshots from scheduler stats, SLA accounting, the per-replica Prometheus exposition, and the metric
declarations of vtoken/metric_names.py against what that exposition really writes."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.ops import exposition, exposition_families, repacked_counters, replica_snapshot, vllm_metric_names
from support.paths import ROOT

from vtoken import metric_names as names
from vtoken.core.reporting.engine_kv import KVSnapshot, ReclaimCounters
from vtoken.serve.launch.local import free_port
from vtoken.serve.telemetry.metrics import ReplicaMetrics, start_metrics_server
from vtoken.serve.telemetry.sla import RequestLatency, SloTargets, latency_of, meets_slo
from vtoken.serve.telemetry.stat_logger import StatsSink, snapshot_from
from vtoken.vllm.gauges import encode


def sched(usage=0.0, running=0, waiting=0, extra=None):
    return SimpleNamespace(
        kv_cache_usage=usage,
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        running_lora_adapters=dict(extra or {}),
    )


def test_snapshot_from_vanilla_and_from_vtoken_stats():
    from vtoken.vllm.gauges import vtoken_stats_from

    vanilla = snapshot_from(
        sched(usage=10 / 63, running=2), pool_blocks=63, block_size=32, vtoken_reader=vtoken_stats_from
    )
    assert (vanilla.held_blocks, vanilla.source, vanilla.free_kv_tokens, vanilla.fragmentation_ratio) == (
        10,
        "vllm",
        53 * 32,
        0.0,
    )
    vt = KVSnapshot(
        live_tokens=100,
        held_blocks=4,
        packing_bound_blocks=4,
        naive_blocks=7,
        pool_blocks=63,
        block_size=32,
        window_blocks=5,
        counters=ReclaimCounters(
            evicted_tokens=50, reclaimed_blocks=3, repack_moves=20, repack_seconds=0.002, repack_plans=5
        ),
        policy="h2o",
        mode="repack",
    )
    snap = snapshot_from(sched(usage=0.5, running=1, extra=encode(vt)), 63, 32, vtoken_stats_from)
    assert (snap.source, snap.held_blocks, snap.naive_blocks, snap.counters.evicted_tokens, snap.num_running) == (
        "vtoken",
        4,
        7,
        50,
        1,
    )
    assert snap.fragmentation_ratio == pytest.approx(1 - 100 / 128)  # of the managed group: window not in it
    assert (snap.window_blocks, snap.free_blocks) == (5, 63 - 4 - 5)
    assert snap.admission_limit is None  # admission off
    from vtoken.vllm.gauges import ADMISSION_LIMIT, admission_limit_from

    for extra in (encode(vt), {}):  # admission's limit reaches the snapshot with vToken's numbers and without
        got = snapshot_from(
            sched(usage=0.5, extra={**extra, ADMISSION_LIMIT: 6}), 63, 32, vtoken_stats_from, admission_limit_from
        )
        assert (got.admission_limit, got.source) == (6, "vtoken" if extra else "vllm")
    assert snap.kv_utilization == pytest.approx((4 + 5) / 63)
    assert snap.free_kv_tokens == (63 - 4 - 5) * 32


def test_latency_and_slo_rules():
    fin = SimpleNamespace(
        num_generation_tokens=11,
        e2e_latency=1.5,
        decode_time=1.0,
        mean_time_per_output_token=0.1,
        finish_reason=SimpleNamespace(name="LENGTH"),
    )
    lat = latency_of(fin)
    assert (lat.ttft_s, lat.tpot_s, lat.finish_reason) == (pytest.approx(0.5), 0.1, "length")
    assert meets_slo(lat, SloTargets.from_ms(500, 100))
    assert not meets_slo(lat, SloTargets.from_ms(499, 100))
    assert not meets_slo(lat, SloTargets.from_ms(500, 99))
    one_token = latency_of(
        SimpleNamespace(
            num_generation_tokens=1,
            e2e_latency=0.2,
            decode_time=0.0,
            mean_time_per_output_token=0.0,
            finish_reason="stop",
        )
    )
    assert one_token.tpot_s is None and meets_slo(one_token, SloTargets.from_ms(300, 1))
    aborted = latency_of(SimpleNamespace(num_generation_tokens=0, e2e_latency=0.2, finish_reason="abort"))
    assert aborted.ttft_s is None and not meets_slo(aborted, SloTargets.from_ms(1e9, 1e9))


# What Prometheus 2.x sends: it prefers OpenMetrics, for which prometheus_client would rewrite ':' to '_'
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def scrape(port: int) -> dict:
    r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_ACCEPT}, timeout=5)
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = r.text
    assert "vtoken_" not in text  # names keep their colons on the sample lines too
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_exposition_has_architecture_names_and_replica_labels():
    sink = StatsSink()
    labels = {"application": "app", "deployment": "Dep", "replica": "r1", "node": "n1"}
    metrics = ReplicaMetrics(sink, SloTargets.from_ms(1000, 100), "h2o", "repack", labels)
    server, port = start_metrics_server(metrics.view, "127.0.0.1", free_port(n=5), 0, span=4)
    try:
        sink.put(replica_snapshot(counters=ReclaimCounters(evicted_tokens=10, reclaimed_blocks=2, repack_moves=7)))
        sink.put(replica_snapshot(window_blocks=10, counters=repacked_counters()))
        sink.finished(RequestLatency(0.2, 0.05, 1.0, 10, "length"))
        sink.finished(RequestLatency(2.0, 0.05, 3.0, 10, "length"))
        m = scrape(port)
    finally:
        server.shutdown()
        server.server_close()

    def value(name: str) -> float:
        return m[name][0][1]

    assert m["vtoken:kv_utilization"][0][0] == {**labels, "mode": "repack"}
    assert value("vtoken:held_blocks") == 4 and value("vtoken:live_tokens") == 96
    assert value("vtoken:packing_bound_blocks") == 3 and value("vtoken:naive_blocks") == 6
    assert value("vtoken:fragmentation_ratio") == pytest.approx(0.25)
    assert value("vtoken:window_blocks") == 10  # a hybrid model's sliding-window blocks count as taken
    assert value("vtoken:kv_utilization") == pytest.approx((4 + 10) / 63)
    assert value("vtoken:free_kv_tokens") == (63 - 4 - 10) * 32
    assert m["vtoken:evicted_tokens_total"][0] == ({**labels, "policy": "h2o"}, 12.0)
    assert value("vtoken:reclaimed_blocks_total") == 3 and value("vtoken:repack_moves_total") == 9
    assert value("vtoken:repack_seconds_count") == 2 and value("vtoken:repack_seconds_sum") == pytest.approx(0.004)
    assert value("vtoken:requests_total") == 2 and value("vtoken:slo_met_total") == 1
    assert value("vtoken:ttft_seconds_count") == 2 and value("vtoken:tpot_seconds_count") == 2
    assert all(labels.items() <= dict(lbl).items() for samples in m.values() for lbl, _ in samples)


def test_busy_metrics_port_falls_back_to_the_next_one():
    import socket

    base = free_port(n=5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", base))
        s.listen()
        metrics = ReplicaMetrics(
            StatsSink(), SloTargets(1, 1), "h2o", "none", {"replica": "x"}, include_process_registry=False
        )
        server, port = start_metrics_server(metrics.view, "127.0.0.1", base, 0, span=4, wait_s=0.2)
        try:
            assert port != base and base < port <= base + 4 and "vtoken:held_blocks" in scrape(port)
        finally:
            server.shutdown()
            server.server_close()


# ------------------------------------------------- vtoken/metric_names.py against the real exporter
def test_exporter_writes_exactly_the_declared_vtoken_metrics_with_their_kind_help_and_labels():
    """Both directions: every ``vtoken:*`` sample the real exporter writes is declared in
    vtoken/metric_names.py, and every declared ``vtoken:*`` series is really written."""
    families = {f.name: f for f in exposition_families() if not f.name.endswith("_created")}
    exported = {s.name for fam in families.values() for s in fam.samples}
    declared = names.series_names(names.VTOKEN_METRICS)
    assert sorted(exported - declared) == [], "exported but not declared in vtoken/metric_names.py"
    assert sorted(declared - exported) == [], "declared in vtoken/metric_names.py but not exported"
    assert {m.owner for m in names.VTOKEN_METRICS} == {"vtoken"}
    assert {m.owner for m in names.VLLM_METRICS} == {"vllm"}
    assert len({m.name for m in names.ALL_METRICS}) == len(names.ALL_METRICS)
    for metric in names.VTOKEN_METRICS:
        (fam,) = [f for f in families.values() if metric.series[0] in {s.name for s in f.samples}]
        assert (fam.type, fam.documentation) == (metric.kind, metric.help), metric.name
        own = {k for s in fam.samples for k in s.labels} - set(names.REPLICA_LABELS) - {"le"}
        assert own == set(metric.labels), metric.name
        assert all(set(names.REPLICA_LABELS) <= s.labels.keys() for s in fam.samples), metric.name


def test_declared_vllm_metrics_are_defined_by_the_installed_vllm():
    """The vLLM-owned names the router, autoscaler and dashboards read exist in vLLM's stat logger."""
    assert sorted(names.series_names(names.VLLM_METRICS) - vllm_metric_names()) == []


def test_router_and_autoscaler_keys_are_declared_and_exported_names():
    from vtoken.serve.telemetry.stat_logger import AUTOSCALING_KEYS, StatsSink, routing_stats

    keys = {k for k in (*routing_stats(StatsSink().latest, 0.0), *AUTOSCALING_KEYS) if ":" in k}
    assert keys and sorted(keys - names.series_names()) == []
    assert sorted({k for k in keys if k.startswith("vtoken:")} - set(exposition())) == []


def test_docs_metrics_md_lists_every_declared_metric():
    text = (ROOT / "docs" / "metrics.md").read_text()
    assert [m.name for m in names.ALL_METRICS if f"`{m.series[0]}`" not in text] == []


def test_metric_declarations_give_the_scraped_series_names():
    assert names.EVICTED_TOKENS.total == "vtoken:evicted_tokens_total"
    assert names.TTFT_SECONDS.series == (
        "vtoken:ttft_seconds_bucket",
        "vtoken:ttft_seconds_sum",
        "vtoken:ttft_seconds_count",
    )
    assert names.KV_UTILIZATION.series == ("vtoken:kv_utilization",)
    with pytest.raises(ValueError, match="not a counter"):
        _ = names.KV_UTILIZATION.total
    with pytest.raises(ValueError, match="kind"):
        names.Metric("vtoken:x", "summary", "x")
    with pytest.raises(ValueError, match="_total"):
        names.Metric("vtoken:x_total", names.COUNTER, "x")
