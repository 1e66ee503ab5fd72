"""Prometheus finds every replica's ``/metrics`` on every node: a registry actor keeps a ``file_sd`` JSON.

::

    VTokenReplica (node A) ──register(id, host:port, labels) every HEARTBEAT_S──▶ MetricsRegistry
    VTokenReplica (node B) ──────────────────────────────────────────────────▶  (detached actor on
                                                                                 the Ray head)
                                   <Ray temp dir>/vtoken_prom_service_discovery.json ◀─┘ atomic rewrite
    Prometheus (on the head) ── file_sd_configs: [{files: [that path]}] ──scrape──▶ each host:port

Why not Ray's own ``prom_metrics_service_discovery.json``: it lists each node's Ray metrics *export*
port, which re-exports through OpenCensus and renames every series (``ray_vtoken_*``); our endpoints
are per replica, on ports only the replica knows (``metrics.port + local rank``, or a fallback port).
The replica is the only process that knows its endpoint, so it registers itself; an entry whose
replica stopped heartbeating (its node died) expires after ``ttl_s``. Under KubeRay the PodMonitor
finds the same endpoints through Kubernetes instead; the registry still runs there and is harmless
(docs/operations.md, "Discovery").

Side effects: ``ensure_registry`` creates (once per cluster) a detached, zero-CPU actor pinned to the
head node; the actor writes the file on every change and from a sweeper thread. Entry labels are
``__meta_vtoken_*`` only, so Prometheus drops them after relabeling and the scraped samples keep their
own ``application``/``deployment``/``replica``/``node`` labels (no ``exported_*`` renames).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REGISTRY_NAME = "vtoken-metrics-registry"
REGISTRY_NAMESPACE = "vtoken"
SD_FILENAME = "vtoken_prom_service_discovery.json"
HEARTBEAT_S = 2.0
TTL_S = 6.0
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def target_address(bind_host: str, node_ip: str, port: int) -> str:
    """``host:port`` Prometheus should scrape (pure): the bind address, or the node's IP for a wildcard."""
    host = node_ip if bind_host in WILDCARD_HOSTS else bind_host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def file_sd_content(entries: Mapping[str, tuple[str, Mapping[str, str], float]]) -> list[dict[str, Any]]:
    """The file_sd JSON document for ``{replica id: (target, labels, last seen)}`` (pure, sorted).

    Labels become ``__meta_vtoken_<name>`` (available to relabeling, never stored on a series)."""
    groups = []
    for replica_id, (target, labels, _) in sorted(entries.items(), key=lambda kv: (kv[1][0], kv[0])):
        meta = {f"__meta_vtoken_{k}": str(v) for k, v in sorted(labels.items())}
        groups.append({"targets": [target], "labels": {**meta, "__meta_vtoken_replica": replica_id}})
    return groups


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` through a rename (Prometheus never reads half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def default_sd_path() -> Path:
    """``<Ray temp dir of this node>/vtoken_prom_service_discovery.json`` (next to Ray's own SD file)."""
    try:
        from ray._private import worker

        temp = worker._global_node.get_temp_dir_path()  # no public API for the node's temp dir
    except Exception:  # noqa: BLE001 - outside a Ray worker: Ray's default root
        temp = "/tmp/ray"
    return Path(temp) / SD_FILENAME


class MetricsRegistry:
    """The cluster's list of live replica endpoints (runs as a Ray actor; plain class for tests).

    Side effects: writes ``path`` on every change (atomic rename) and starts a daemon thread that
    expires entries not refreshed for ``ttl_s`` seconds."""

    def __init__(self, path: str | None = None, ttl_s: float = TTL_S, sweep_s: float = 1.0) -> None:
        self.path = Path(path) if path else default_sd_path()
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[str, dict[str, str], float]] = {}
        self._written: str | None = None
        self._flush()
        self._stop = threading.Event()
        threading.Thread(target=self._sweep, args=(sweep_s,), name="vtoken-sd-sweep", daemon=True).start()

    def register(self, replica_id: str, target: str, labels: Mapping[str, str]) -> str:
        """Add or refresh one replica's endpoint; returns the file's path (for logs and tests)."""
        with self._lock:
            self._entries[replica_id] = (target, dict(labels), time.monotonic())
        self._flush()
        return str(self.path)

    def unregister(self, replica_id: str) -> None:
        with self._lock:
            self._entries.pop(replica_id, None)
        self._flush()

    def targets(self) -> list[dict[str, Any]]:
        """The file_sd document as last computed (what the file holds)."""
        with self._lock:
            return file_sd_content(self._entries)

    def sd_path(self) -> str:
        return str(self.path)

    def expire(self, now: float | None = None) -> list[str]:
        """Drop entries older than ``ttl_s``; returns their replica ids (mutates, rewrites the file)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [r for r, (_, _, seen) in self._entries.items() if now - seen > self.ttl_s]
            for replica_id in old:
                del self._entries[replica_id]
        if old:
            self._flush()
        return old

    def _sweep(self, period: float) -> None:
        while not self._stop.wait(period):
            self.expire()

    def _flush(self) -> None:
        with self._lock:
            text = json.dumps(file_sd_content(self._entries), indent=1)
            if text == self._written:
                return
            write_atomically(self.path, text + "\n")
            self._written = text


def ensure_registry(sd_file: str | None, ttl_s: float = TTL_S):
    """The registry actor's handle, created on the head node if this cluster has none (needs Ray).

    ``get_if_exists`` makes concurrent first replicas share one actor. Detached: it outlives the
    replica that created it (a replica's death must not take everyone's discovery with it)."""
    import ray

    actor = ray.remote(MetricsRegistry).options(
        name=REGISTRY_NAME,
        namespace=REGISTRY_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=8,
        resources={"node:__internal_head__": 0.001},
    )
    return actor.remote(sd_file, ttl_s)
