"""Grafana dashboards (dashboards/): committed JSON = generator output, every panel's PromQL parses, reads
only exported names with the template filters, and returns data from a real Prometheus scraping the
replica's real exposition code."""

from __future__ import annotations

import json
import math
import re
import threading
import time

import httpx
import pytest
from support.ops import exported_names, load_module, promtool_check_exprs, replica_snapshot, selectors
from support.paths import ROOT

from vtoken import metric_names as mn

build = load_module(ROOT / "dashboards" / "build.py")
rules = load_module(ROOT / "k8s" / "rules.py")
MODELS = build.dashboards()


def all_queries() -> list[tuple[str, str, str]]:
    return [(name, title, expr) for name, model in MODELS.items() for title, expr in build.panel_queries(model)]


def test_committed_json_is_the_generated_json_and_generation_is_deterministic():
    assert build.main(["--check"]) == 0, "run: python dashboards/build.py"
    for name, model in MODELS.items():
        again = build.dump(build.dashboards()[name])
        assert (ROOT / "dashboards" / name).read_text() == build.dump(model) == again
        assert json.loads((ROOT / "dashboards" / name).read_text())["uid"] == name.removesuffix(".json")


def test_every_panel_has_promql_on_exported_metrics_filtered_by_deployment_and_replica():
    exported = exported_names()
    for name, model in MODELS.items():
        panels = [p for p in model["panels"] if p["type"] != "row"]
        assert len({p["id"] for p in model["panels"]}) == len(model["panels"]), f"{name}: duplicate panel ids"
        for panel in panels:
            assert panel.get("targets"), f"{name}: panel {panel['title']!r} has no query"
            for target in panel["targets"]:
                for sel in selectors(build.concrete(target["expr"])):
                    assert sel.name in exported, f"{panel['title']}: {sel.name} is not exported"
        for title, expr in build.panel_queries(model):
            for sel in selectors(expr.replace("$__rate_interval", "1m").replace("$__range", "1h")):
                matchers = {(m.name, m.value) for m in sel.matchers.matchers}
                filters = {("deployment", "$deployment"), ("node", "$node"), ("replica", "$replica")}
                assert filters <= matchers, (title, sel.name)
        variables = {v["name"]: v for v in model["templating"]["list"]}
        assert {"datasource", "deployment", "node", "replica"} <= variables.keys()
        for var in ("deployment", "node", "replica"):
            (metric,) = re.findall(r"label_values\((\w[\w:]*)", variables[var]["query"])
            assert metric in exported and variables[var]["includeAll"] and variables[var]["allValue"] == ".*"


def test_dashboards_cover_the_kv_and_sla_series_and_share_the_alert_thresholds():
    names = {
        name: set().union(*(set(s.name for s in selectors(build.concrete(e))) for _, e in build.panel_queries(model)))
        for name, model in MODELS.items()
    }
    assert {
        "vtoken:held_blocks",
        "vtoken:naive_blocks",
        "vtoken:packing_bound_blocks",
        "vtoken:fragmentation_ratio",
        "vtoken:kv_utilization",
        "vtoken:reclaimed_blocks_total",
        "vtoken:repack_moves_total",
        "vtoken:repack_seconds_bucket",
        "vtoken:evicted_tokens_total",
        "vtoken:invariant_violations_total",
        "vtoken:invariant_checks_total",
        "vtoken:request_evicted_share_bucket",
        "vtoken:request_evicted_share_count",
        "vtoken:request_evicted_mass_bucket",
        "vtoken:pressure_rounds_total",
    } <= names["vtoken-kv.json"]
    assert {
        "vtoken:slo_met_total",
        "vtoken:requests_total",
        "vtoken:ttft_seconds_bucket",
        "vtoken:tpot_seconds_bucket",
        "vllm:num_requests_waiting",
    } <= names["vtoken-sla.json"]
    quantiles = [e for _, _, e in all_queries() if "histogram_quantile" in e]
    found = {float(q) for e in quantiles for q in re.findall(r"histogram_quantile\(([\d.]+)", e)}
    assert found == {0.5, 0.95, 0.99}
    # the panel thresholds and the alert expressions use the thresholds declared in vtoken/metric_names.py
    steps = {
        p["title"]: {s["value"] for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"]} - {None}
        for model in MODELS.values()
        for p in model["panels"]
        if "thresholds" in p.get("fieldConfig", {}).get("defaults", {})
    }
    assert steps == {
        "KV utilization per replica": {mn.KV_SATURATED},
        "Fragmentation ratio per replica": {mn.FRAGMENTATION_MAX},
        "SLA attainment (time range)": {mn.SLO_TARGET},
        "SLA attainment, overall and per replica": {mn.SLO_TARGET},
        "Requests trimmed": {mn.TRIMMED_SHARE_MAX},
    }
    assert f") > {mn.TRIMMED_SHARE_MAX}\n" in rules.cost_rules()[0]["expr"]
    exprs = {r["alert"]: r["expr"] for r in rules.kv_rules()}
    assert f"{mn.KV_UTILIZATION.name} > {mn.KV_SATURATED}\n" == exprs["VTokenKVSaturated"]
    fragmentation = f"{mn.FRAGMENTATION_RATIO.name} > {mn.FRAGMENTATION_MAX}\n"
    assert exprs["VTokenKVFragmentationHigh"].startswith(fragmentation)
    assert f"[{mn.INVARIANT_WINDOW}]" in exprs["VTokenKVInvariantViolated"]
    assert all(f"target {mn.SLO_TARGET:.0%}" in r["annotations"]["description"] for r in rules.slo_rules())


def test_every_panel_promql_parses_with_promtool(tmp_path):
    exprs = [build.concrete(e) for _, _, e in all_queries()]
    out = promtool_check_exprs(exprs, tmp_path)
    assert out.returncode == 0 and f"{len(exprs)} rules found" in out.stdout, out.stdout + out.stderr
    broken = promtool_check_exprs(["sum(rate(vtoken:requests_total[1m])"], tmp_path)  # the check has teeth
    assert broken.returncode != 0


# ------------------------------------------------------------------------------- against a real Prometheus
class Replica:
    """One replica's real exposition (ReplicaMetrics + LabelledView + start_metrics_server), fed with KV
    snapshots and finished requests. vLLM's own queue gauges come from a stand-in registry (no engine)."""

    def __init__(self, name: str, port: int, node: str) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        from vtoken.serve.telemetry.metrics import LabelledView, ReplicaMetrics, start_metrics_server
        from vtoken.serve.telemetry.sla import SloTargets
        from vtoken.serve.telemetry.stat_logger import StatsSink

        labels = {"application": "vtoken", "deployment": "VTokenReplica", "replica": name, "node": node}
        self.sink = StatsSink(pool_blocks=63)
        self.metrics = ReplicaMetrics(
            self.sink, SloTargets.from_ms(1000, 100), "h2o", "repack", labels, include_process_registry=False
        )
        vllm = CollectorRegistry()
        Gauge("vllm:num_requests_waiting", "stand-in", registry=vllm).set(2)
        Gauge("vllm:num_requests_running", "stand-in", registry=vllm).set(3)
        view = CollectorRegistry(auto_describe=False)
        view.register(LabelledView([self.metrics.registry, vllm], labels))
        self.server, self.port = start_metrics_server(view, "127.0.0.1", port, 0, span=0, wait_s=0)
        assert self.server is not None, f"port {port} busy"
        self.step = 0
        self.costs = None

    def tick(self) -> None:
        from vtoken.core.reporting.engine_kv import ReclaimCounters
        from vtoken.core.reporting.request_cost import CostStats, RequestCost
        from vtoken.serve.telemetry.sla import RequestLatency

        i = self.step = self.step + 1
        self.costs = (self.costs or CostStats()).add(RequestCost(0, 50)).add(RequestCost(30, 100, 0.05 + i % 3 / 100))
        self.sink.put(
            replica_snapshot(
                live_tokens=90 + i % 7,
                admission_limit=8,
                counters=ReclaimCounters(
                    evicted_tokens=10 * i,
                    reclaimed_blocks=i,
                    repack_moves=5 * i,
                    repack_seconds=0.001 * i,
                    repack_plans=i,
                    pressure_rounds=i,
                ),
                costs=self.costs,
            )
        )
        self.sink.finished(RequestLatency(0.2 if i % 3 else 3.0, 0.05, 1.0, 10, "length"))


@pytest.mark.timeout(180)
def test_every_panel_returns_data_from_prometheus_scraping_the_replica_exporter():
    from support.serve import PrometheusServer, wait_for

    from vtoken.serve.launch.local import free_port

    base = free_port(n=2)
    replicas = [Replica("r1", base, "n1"), Replica("r2", base + 1, "n2")]
    stop = threading.Event()

    def feed():
        while not stop.is_set():
            for r in replicas:
                r.tick()
            stop.wait(0.25)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        with PrometheusServer([f"127.0.0.1:{r.port}" for r in replicas], port=free_port()) as prom:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(prom.query("vtoken:kv_utilization[10s]")) < 2:
                time.sleep(1)
            wait_for(
                lambda: (
                    len(points := prom.query("count_over_time(vtoken:kv_utilization[1m])")) >= 2
                    and all(float(p["value"][1]) >= 4 for p in points)
                ),
                "four scrapes of every replica, so rate() over 1m has points",
                60,
                0.5,
            )
            empty = []
            for name, title, expr in all_queries():
                result = prom.query(build.concrete(expr, rate="1m", range_="1m"))
                values = [float(s["value"][1]) for s in result]
                if not values or all(math.isnan(v) for v in values):
                    empty.append(f"{name} / {title}: {expr}")
            assert empty == [], "panels without data:\n" + "\n".join(empty)
            for var in ("deployment", "node", "replica"):
                r = httpx.get(f"{prom.url}/api/v1/label/{var}/values", params={"match[]": "vtoken:kv_utilization"})
                assert len(r.json()["data"]) == {"deployment": 1, "node": 2, "replica": 2}[var]
            util = mn.KV_UTILIZATION.name
            per_node = prom.query(build.concrete(f"count by (node) ({util}{{{build.SEL}}})"))
            assert sorted(s["metric"]["node"] for s in per_node) == ["n1", "n2"]  # per-node panels' grouping
    finally:
        stop.set()
        feeder.join()
        for r in replicas:
            r.server.shutdown()
            r.server.server_close()
