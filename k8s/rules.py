"""vToken's Prometheus alerts (rendered into k8s/prometheusrule.yaml by k8s/render.py).

The only vtoken import is vtoken/metric_names.py (standard library only): every metric name and the
thresholds SLO_TARGET, KV_SATURATED, FRAGMENTATION_MAX and TRIMMED_SHARE_MAX come from there, the same declarations the
exporter (vtoken/serve/telemetry/metrics.py) and the dashboards use. k8s/render.py puts the repository root on
``sys.path`` before importing this file, so rendering needs pyyaml and the checkout, not an installed vtoken.

Every expression uses only names a replica exports (vtoken/serve/telemetry/metrics.py, docs/metrics.md) plus
Prometheus' own ``up`` for the scrape target; tests/e2e/test_k8s.py checks that, parses each expression
with ``promtool check rules`` and proves each alert fires and stays silent with ``promtool test rules``
on k8s/tests/rules_test.yaml. The runbook of every alert is the section of docs/operations.md whose
heading is the alert's name.

SLO burn follows the multi-window, multi-burn-rate recipe of the Google SRE workbook (ch. 5): with an
SLO target T (share of finished requests meeting both the TTFT and TPOT objectives of the Serve config),
the error budget is 1 - T; an alert needs the error ratio above ``factor * (1 - T)`` over a long window
(the budget is really burning) *and* a short one (it is still burning now, so the alert resolves fast).
"""

from __future__ import annotations

from vtoken import metric_names as names
from vtoken.metric_names import FRAGMENTATION_MAX, KV_SATURATED, SLO_TARGET, TRIMMED_SHARE_MAX, TRIMMED_WINDOW

SCRAPE_JOB = "vtoken"  # the PodMonitor relabels job to this (k8s/render.py)
METRICS_PORT_NAME = "vtoken-metrics"  # container port name = PodMonitor endpoint label
RUNBOOK = "docs/operations.md#{anchor}"
SLO_BY = "namespace, application, deployment"

# (alert, severity, long window, short window, burn factor, for)
BURN_ALERTS = (
    ("VTokenSLOBurnFast", "critical", "1h", "5m", 14.4, "2m"),  # 2% of a 30-day budget in 1 h
    ("VTokenSLOBurnSlow", "warning", "6h", "30m", 6.0, "15m"),  # 5% of a 30-day budget in 6 h
)
# VTokenKVFragmentationHigh: fragmentation_ratio > FRAGMENTATION_MAX while the pool is this full
# (empty pools fragment harmlessly); rules only, the dashboards do not draw it.
FRAGMENTATION_WHEN_KV_ABOVE = 0.5


def error_ratio(window: str) -> str:
    """Share of finished requests that missed the SLO over ``window`` (NaN without traffic: no alert)."""
    return (
        f"1 - sum by ({SLO_BY}) (rate({names.SLO_MET.total}[{window}]))\n"
        f"  / sum by ({SLO_BY}) (rate({names.REQUESTS.total}[{window}]))"
    )


def _threshold(factor: float) -> str:
    return repr(round(factor * (1 - SLO_TARGET), 6))


def _alert(name: str, expr: str, severity: str, duration: str, summary: str, description: str) -> dict:
    return {
        "alert": name,
        "expr": expr,
        "for": duration,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": description, "runbook": RUNBOOK.format(anchor=name.lower())},
    }


def slo_rules() -> list[dict]:
    rules = []
    for name, severity, long, short, factor, duration in BURN_ALERTS:
        limit = _threshold(factor)
        expr = f"(\n  {error_ratio(long)}\n) > {limit}\nand\n(\n  {error_ratio(short)}\n) > {limit}\n"
        rules.append(
            _alert(
                name,
                expr,
                severity,
                duration,
                "vToken SLO error budget burning {{ $labels.deployment }} (" + f"{factor:g}x over {long} and {short})",
                "{{ $value | humanizePercentage }} of finished requests of {{ $labels.namespace }}/"
                "{{ $labels.deployment }} missed the TTFT/TPOT SLO over the last "
                + long
                + f"; the objective allows {1 - SLO_TARGET:.0%} (target {SLO_TARGET:.0%}).",
            )
        )
    return rules


def kv_rules() -> list[dict]:
    return [
        _alert(
            "VTokenKVFragmentationHigh",
            f"{names.FRAGMENTATION_RATIO.name} > {FRAGMENTATION_MAX}\n"
            f"and\n{names.KV_UTILIZATION.name} > {FRAGMENTATION_WHEN_KV_ABOVE}\n",
            "warning",
            "15m",
            "vToken KV fragmentation high on replica {{ $labels.replica }}",
            "{{ $value | humanizePercentage }} of the KV slots held by replica {{ $labels.replica }} "
            f"(mode {{{{ $labels.mode }}}}) hold no live token while its pool is over "
            f"{FRAGMENTATION_WHEN_KV_ABOVE:.0%} full.",
        ),
        _alert(
            "VTokenKVSaturated",
            f"{names.KV_UTILIZATION.name} > {KV_SATURATED}\n",
            "warning",
            "10m",
            "vToken KV cache saturated on replica {{ $labels.replica }}",
            "Replica {{ $labels.replica }} holds {{ $value | humanizePercentage }} of its KV blocks "
            "for 10 minutes; new requests queue or preempt.",
        ),
        _alert(
            "VTokenKVInvariantViolated",
            f"increase({names.INVARIANT_VIOLATIONS.total}[{names.INVARIANT_WINDOW}]) > 0\n",
            "critical",
            "0m",
            "vToken KV invariant violated on replica {{ $labels.replica }}",
            "Replica {{ $labels.replica }} found {{ $value }} KV invariant violation(s) in the last "
            f"{names.INVARIANT_WINDOW} (a leaked or miscounted block, a broken token table or a rewritten "
            "prefix-cached block); its engine log names the requests and blocks.",
        ),
    ]


def cost_rules() -> list[dict]:
    return [
        _alert(
            "VTokenRequestsTrimmed",
            f"(\n  {names.trimmed_share(by=SLO_BY)}\n) > {TRIMMED_SHARE_MAX}\n",
            "warning",
            "5m",
            "vToken requests losing context on {{ $labels.deployment }}",
            "{{ $value | humanizePercentage }} of the requests {{ $labels.namespace }}/{{ $labels.deployment }} "
            f"finished over the last {TRIMMED_WINDOW} lost context to eviction (threshold "
            f"{TRIMMED_SHARE_MAX:.0%}): memory is short for the load; add replicas or lower the load.",
        )
    ]


def replica_rules() -> list[dict]:
    target = f'up{{job="{SCRAPE_JOB}", endpoint="{METRICS_PORT_NAME}"}}'
    return [
        _alert(
            "VTokenReplicaDown",
            f"{target} == 0\n",
            "critical",
            "5m",
            "vToken replica metrics endpoint down on pod {{ $labels.pod }}",
            "Prometheus cannot scrape {{ $labels.instance }} "
            "(pod {{ $labels.namespace }}/{{ $labels.pod }}) "
            "for 5 minutes: the Serve replica on that GPU worker is dead, restarting or hung.",
        ),
        _alert(
            "VTokenNoReplicas",
            f"absent({target} == 1)\n",
            "critical",
            "5m",
            "No vToken replica is up",
            "No vToken replica metrics endpoint has been scraped successfully for 5 minutes.",
        ),
    ]


def prometheus_rule(name: str, labels: dict[str, str]) -> dict:
    """The PrometheusRule object (monitoring.coreos.com/v1)."""
    groups = [
        {"name": "vtoken.slo", "rules": slo_rules()},
        {"name": "vtoken.kv", "rules": kv_rules()},
        {"name": "vtoken.cost", "rules": cost_rules()},
        {"name": "vtoken.replicas", "rules": replica_rules()},
    ]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {"groups": groups},
    }
