"""The replicas' Prometheus discovery (vtoken/serve/telemetry/discovery.py) without Ray: the file_sd
document, the target address, heartbeats, expiry of a lost replica, and a real Prometheus reading the
file the registry writes (the multi-node test does the same with replicas on Ray nodes)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import httpx
import pytest
from support.serve import wait_for

from vtoken.serve.telemetry import discovery
from vtoken.serve.telemetry.discovery import MetricsRegistry, file_sd_content, target_address


def test_target_is_the_bind_address_or_the_node_ip_for_a_wildcard():
    assert target_address("127.0.0.1", "10.0.0.7", 9500) == "127.0.0.1:9500"
    assert target_address("0.0.0.0", "10.0.0.7", 9501) == "10.0.0.7:9501"
    assert target_address("::", "fd00::7", 9500) == "[fd00::7]:9500"


def test_file_sd_groups_carry_only_meta_labels():
    doc = file_sd_content(
        {"r2": ("h:2", {"node": "n2", "deployment": "D"}, 0.0), "r1": ("h:1", {"node": "n1", "deployment": "D"}, 0.0)}
    )
    assert [g["targets"] for g in doc] == [["h:1"], ["h:2"]]
    assert doc[0]["labels"] == {
        "__meta_vtoken_deployment": "D",
        "__meta_vtoken_node": "n1",
        "__meta_vtoken_replica": "r1",
    }
    assert all(k.startswith("__meta_") for g in doc for k in g["labels"])  # dropped after relabeling


def test_registry_writes_the_file_and_expires_replicas_that_stop_heartbeating(tmp_path, monkeypatch):
    """On the registry's clock (a fake ``time.monotonic`` for ``register``; ``expire(now=…)``), with
    ``ttl_s`` 6: a and b register at 100, a heartbeats at 103, b does not (its node died). An entry
    goes when more than ``ttl_s`` passed since it was last seen: at 106.0 nothing (b exactly 6 s old),
    at 106.5 b, at 109.0 nothing (a exactly 6 s after its heartbeat), at 109.5 a."""
    clock = [100.0]
    monkeypatch.setattr(discovery, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    path = tmp_path / "sd" / "vtoken_prom_service_discovery.json"
    reg = MetricsRegistry(str(path), ttl_s=6.0, sweep_s=3600)  # the sweeper stays out of the way
    try:

        def listed() -> list[str]:
            return [g["targets"][0] for g in json.loads(path.read_text())]

        assert listed() == []
        reg.register("a", "127.0.0.1:1", {"node": "n1"})
        reg.register("b", "127.0.0.1:2", {"node": "n2"})
        assert listed() == ["127.0.0.1:1", "127.0.0.1:2"]
        clock[0] = 103.0
        reg.register("a", "127.0.0.1:1", {"node": "n1"})  # a heartbeat refreshes a's last-seen time
        assert reg.expire(now=106.0) == [] and listed() == ["127.0.0.1:1", "127.0.0.1:2"]
        assert reg.expire(now=106.5) == ["b"] and listed() == ["127.0.0.1:1"]
        assert reg.expire(now=109.0) == [] and listed() == ["127.0.0.1:1"]
        assert reg.expire(now=109.5) == ["a"] and listed() == []
        reg.register("a", "127.0.0.1:1", {"node": "n1"})  # back (heartbeat at 103 on the fake clock)
        reg.unregister("a")  # a replica shut down by Serve removes itself
        assert listed() == [] and not list(path.parent.glob(".*.tmp"))
    finally:
        reg._stop.set()


def test_the_sweeper_expires_on_the_registry_clock(tmp_path, monkeypatch):
    """The sweeper thread calls ``expire()`` (the clock's now) every ``sweep_s``: an entry 7 s old on
    the registry's clock (ttl 6) leaves the file without anyone calling ``expire``. Waits only for the
    thread's next round (0.01 s), never for the TTL."""
    clock = [100.0]
    monkeypatch.setattr(discovery, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    path = tmp_path / "sd.json"
    reg = MetricsRegistry(str(path), ttl_s=6.0, sweep_s=0.01)
    try:
        reg.register("b", "127.0.0.1:2", {"node": "n2"})
        assert json.loads(path.read_text()) != []
        clock[0] = 107.0
        # the real clock: a bound on a stalled thread, not the TTL
        wait_for(lambda: json.loads(path.read_text()) == [], "the sweeper to expire b", 10.0, 0.005)
    finally:
        reg._stop.set()


@pytest.mark.timeout(120)
def test_prometheus_finds_the_registered_endpoints_through_file_sd(tmp_path):
    from support.serve import PrometheusServer

    from vtoken.serve.launch.local import free_port
    from vtoken.serve.telemetry.metrics import ReplicaMetrics, start_metrics_server
    from vtoken.serve.telemetry.sla import SloTargets
    from vtoken.serve.telemetry.stat_logger import StatsSink

    path = tmp_path / "sd.json"
    reg = MetricsRegistry(str(path), ttl_s=60)
    servers = []
    base = free_port(n=2)
    for i, node in enumerate(("n1", "n2")):
        labels = {"application": "vtoken", "deployment": "VTokenReplica", "replica": f"r{i}", "node": node}
        metrics = ReplicaMetrics(
            StatsSink(pool_blocks=63), SloTargets(1, 1), "h2o", "repack", labels, include_process_registry=False
        )
        server, port = start_metrics_server(metrics.view, "127.0.0.1", base + i, 0, span=0, wait_s=0)
        servers.append(server)
        reg.register(f"r{i}", target_address("127.0.0.1", "unused", port), {"node": node})
    try:
        with PrometheusServer([], port=free_port(), sd_files=[str(path)]) as prom:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(prom.query("vtoken:kv_utilization")) < 2:
                time.sleep(1)
            series = prom.query("count by (node) (vtoken:kv_utilization)")
            assert sorted(s["metric"]["node"] for s in series) == ["n1", "n2"]
            up = httpx.get(f"{prom.url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
            assert sorted(t["labels"]["instance"] for t in up) == [f"127.0.0.1:{p}" for p in (base, base + 1)]
            assert all("exported_node" not in s["metric"] for s in prom.query("vtoken:kv_utilization"))
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
