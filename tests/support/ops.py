"""Helpers for the operations tests (test_k8s.py, test_dashboards.py, test_serve_metrics.py): CRD schemas as
JSON Schema, the metric names the app really exports, PromQL selectors, promtool.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from functools import cache, lru_cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from .paths import ROOT

SCHEMAS = ROOT / "k8s" / "schemas"
REPLICA_LABELS = {"application": "vtoken", "deployment": "VTokenReplica", "replica": "r1", "node": "n1"}


def load_module(path: Path):
    """Import a script (k8s/render.py, dashboards/build.py) by path, without making it a package."""
    spec = importlib.util.spec_from_file_location(f"_ops_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_yaml(path: Path):
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


# ----------------------------------------------------------------------------------- CRD -> JSON Schema
_OBJECT_META = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "maxLength": 63, "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "namespace": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


_DROPPED = ("nullable", "description", "format", "default")


def structural_to_jsonschema(node, strict: bool = True):
    """Kubernetes structural schema (openAPIV3Schema) -> JSON Schema, the way the API server validates:

    * ``nullable: true`` admits null; ``x-kubernetes-int-or-string`` admits integer or string;
    * unknown fields are *rejected* (kubectl's default ``--validate=strict``; the server would otherwise
      prune them silently) unless ``x-kubernetes-preserve-unknown-fields`` or ``additionalProperties``;
    * ``x-kubernetes-list-type: set`` -> unique items; ``map`` -> unique ``x-kubernetes-list-map-keys``
      (checked by the ``listMapKeys`` keyword of ``crd_validator``).
    CEL rules (``x-kubernetes-validations``) are not evaluated (no CEL interpreter offline).
    """
    if isinstance(node, list):
        return [structural_to_jsonschema(n, strict) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "properties":  # a map of field names (a field may be called "format" or "default")
            out[key] = {name: structural_to_jsonschema(sub, strict) for name, sub in value.items()}
        elif key == "pattern":  # Go RE2 allows an inline (?i) after ^; Python wants global flags first
            out[key] = "(?i)" + value.replace("(?i)", "") if "(?i)" in value else value
        elif not key.startswith("x-kubernetes-") and key not in _DROPPED:
            out[key] = structural_to_jsonschema(value, strict)
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        strict
        and "properties" in out
        and "additionalProperties" not in out
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    if node.get("x-kubernetes-list-type") == "map":  # keys missing from an item take their default
        item = node.get("items", {}).get("properties", {})
        out["listMapKeys"] = {k: item.get(k, {}).get("default") for k in node["x-kubernetes-list-map-keys"]}
    return out


def _list_map_keys(validator, keys, instance, schema):
    if not isinstance(instance, list):
        return
    seen = set()
    for item in instance:
        key = tuple(item.get(k, default) for k, default in keys.items()) if isinstance(item, dict) else (item,)
        if key in seen:
            yield jsonschema.ValidationError(f"duplicate entry for list-map keys {list(keys)}: {key}")
        seen.add(key)


_Validator = jsonschema.validators.extend(jsonschema.Draft7Validator, {"listMapKeys": _list_map_keys})


@cache
def crd_validator(file_name: str, version: str = "v1"):
    """A validator for one served version of the CRD in k8s/schemas/ (apiVersion/kind/metadata strict)."""
    crd = load_yaml(SCHEMAS / file_name)
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = structural_to_jsonschema(ver["schema"]["openAPIV3Schema"])
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    schema["properties"].update(apiVersion={"const": f"{group}/{version}"}, kind={"const": kind}, metadata=_OBJECT_META)
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
    schema.get("properties", {}).pop("status", None)
    _Validator.check_schema(schema)
    return _Validator(schema)


def schema_errors(file_name: str, obj: dict) -> list[str]:
    return [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in crd_validator(file_name).iter_errors(obj)
    ]


# ------------------------------------------------------------------------------------ exported names
def replica_snapshot(**fields):
    """A ``KVSnapshot`` of one small replica: 96 live tokens held in 4 of 63 blocks of 32 (3 by the packing
    bound, 6 by the naive rule), one request running; ``fields`` replace any of those or set others."""
    from vtoken.core.reporting.engine_kv import KVSnapshot

    small = dict(
        live_tokens=96,
        held_blocks=4,
        packing_bound_blocks=3,
        naive_blocks=6,
        pool_blocks=63,
        block_size=32,
        num_running=1,
    )
    return KVSnapshot(**{**small, **fields})


def repacked_counters():
    """``ReclaimCounters`` after two repack plans: 12 tokens evicted, 3 blocks reclaimed, 9 moves in 4 ms."""
    from vtoken.core.reporting.engine_kv import ReclaimCounters

    return ReclaimCounters(evicted_tokens=12, reclaimed_blocks=3, repack_moves=9, repack_seconds=0.004, repack_plans=2)


@lru_cache(maxsize=1)
def exposition_families() -> tuple:
    """The metric families the replica's real exposition code (vtoken/serve/telemetry/metrics.py
    ``ReplicaMetrics`` and its labelled view) writes after one KV snapshot, one repack plan and one finished
    request, parsed back from ``generate_latest`` text — the ``vtoken:*`` names exactly as scraped. No vLLM
    in it."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from vtoken.serve.telemetry.metrics import ReplicaMetrics
    from vtoken.serve.telemetry.sla import RequestLatency, SloTargets
    from vtoken.serve.telemetry.stat_logger import StatsSink

    sink = StatsSink()
    metrics = ReplicaMetrics(
        sink, SloTargets.from_ms(1000, 100), "h2o", "repack", REPLICA_LABELS, include_process_registry=False
    )
    sink.put(replica_snapshot(admission_limit=5, counters=repacked_counters()))
    sink.finished(RequestLatency(0.2, 0.05, 1.0, 10, "length"))
    return tuple(text_string_to_metric_families(generate_latest(metrics.view).decode()))


def exposition() -> dict[str, dict]:
    """Sample name -> labels of one sample, from ``exposition_families()``."""
    return {s.name: s.labels for fam in exposition_families() for s in fam.samples}


@lru_cache(maxsize=1)
def vllm_metric_names() -> frozenset[str]:
    """``vllm:*`` names defined in the installed vLLM's Prometheus stat logger (read as text, not imported),
    with the sample suffixes prometheus_client adds."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed"
    source = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"
    names = set(re.findall(r'"(vllm:[a-z_]+)"', source.read_text()))
    assert "vllm:num_requests_waiting" in names, f"no vLLM metric names found in {source}"
    return frozenset(n + s for n in names for s in ("", "_total", "_bucket", "_sum", "_count"))


def exported_names() -> set[str]:
    """What a dashboard or alert may read: every sample name the real exporter writes (not the declarations
    of vtoken/metric_names.py, so a name that is declared but not exported still fails), plus the series of
    the vLLM metrics declared there (the replica relays vLLM's registry unchanged; test_serve_metrics.py
    checks that the installed vLLM defines them)."""
    from vtoken.metric_names import VLLM_METRICS, series_names

    return set(exposition()) | set(series_names(VLLM_METRICS))


# ---------------------------------------------------------------------------------------------- PromQL
def selectors(expr: str) -> list:
    """Every VectorSelector in ``expr`` (parsed with promql-parser; raises on a syntax error)."""
    import promql_parser as pp

    found, stack = [], [pp.parse(expr)]
    while stack:
        node = stack.pop()
        if isinstance(node, pp.VectorSelector):
            found.append(node)
        elif isinstance(node, pp.MatrixSelector):
            found.append(node.vector_selector)
        for attr in ("expr", "lhs", "rhs", "param"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, (str, int, float)):
                stack.append(child)
        stack.extend(getattr(node, "args", None) or [])
    return found


def metric_names(expr: str) -> set[str]:
    names = set()
    for sel in selectors(expr):
        assert sel.name, f"selector without a metric name in {expr!r}"
        names.add(sel.name)
    return names


def promtool() -> str:
    """Path of promtool; FAILS (does not skip) when missing: the rule and PromQL checks need it."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool not found on PATH: install the Debian package 'prometheus' "
            "(scripts/install-system-deps.sh) — the alert and dashboard PromQL checks need it"
        )
    return path


def promtool_check_exprs(exprs: list[str], workdir: Path) -> subprocess.CompletedProcess:
    """``promtool check rules`` on one recording rule per expression (promtool parses the PromQL)."""
    rules = [{"record": f"check:expr_{i}", "expr": e} for i, e in enumerate(exprs)]
    (workdir / "exprs.yaml").write_text(yaml.safe_dump({"groups": [{"name": "exprs", "rules": rules}]}))
    return subprocess.run([promtool(), "check", "rules", "exprs.yaml"], cwd=workdir, capture_output=True, text=True)
