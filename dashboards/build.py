"""vToken's Grafana dashboards, generated with grafana-foundation-sdk (the committed JSON is this output).

    python dashboards/build.py          # rewrite dashboards/vtoken-kv.json and dashboards/vtoken-sla.json
    python dashboards/build.py --check  # exit 1 if the committed JSON differs (tests/e2e/test_dashboards.py)

Every query reads only series a replica exports, each named through its declaration in
vtoken/metric_names.py (the queue panel reads vLLM's own ``vllm:num_requests_*`` gauges, which the
replica exposes unchanged), and filters every selector by the ``$deployment``, ``$node`` and ``$replica``
template variables (``node`` is the Ray node id a replica runs on; the "Per node" panels group by it).
The panel thresholds are the alert thresholds declared in that module too (k8s/rules.py uses the same).
Side effect of importing this file: the repository root goes on ``sys.path``, so the stdlib-only
vtoken/metric_names.py of this checkout is used. Import: Grafana → Dashboards → New → Import → upload
the JSON, pick the Prometheus data source (docs/operations.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.builders import stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    TooltipDisplayMode,
)
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    VariableRefresh,
    VariableSort,
)

OUT = Path(__file__).resolve().parent
if str(OUT.parent) not in sys.path:
    sys.path.insert(0, str(OUT.parent))
from vtoken import metric_names as names  # noqa: E402

DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'deployment=~"$deployment", node=~"$node", replica=~"$replica"'
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.95, 0.99)


def _q(expr: str, legend: str) -> prom.Dataquery:
    return prom.Dataquery().expr(expr).legend_format(legend)


def _thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    return db.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps([Threshold(value=v, color=c) for v, c in steps])


def _panel(kind, title: str, description: str, unit: str, targets: list[prom.Dataquery], span: int = 12):
    panel = kind.Panel().title(title).description(description).unit(unit).datasource(DS).span(span).height(8)
    for ref, target in zip("ABCDEFGH", targets):
        panel = panel.with_target(target.ref_id(ref))
    if kind is timeseries:
        return panel.legend(
            cb.VizLegendOptions()
            .display_mode(LegendDisplayMode.LIST)
            .placement(LegendPlacement.BOTTOM)
            .show_legend(True)
        ).tooltip(cb.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING))
    return panel.reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))


def _quantiles(metric: names.Metric) -> list[prom.Dataquery]:
    rate = f"rate({metric.bucket}{{{SEL}}}[{RATE}])"
    return [_q(f"histogram_quantile({q}, sum by (le) ({rate}))", f"p{q * 100:g}") for q in QUANTILES]


def _per_replica_rate(metric: names.Metric, by: str = "replica") -> prom.Dataquery:
    return _q(f"sum by ({by}) (rate({metric.total}{{{SEL}}}[{RATE}]))", "{{" + by + "}}")


def _selector(name: str, label: str, series: str) -> db.QueryVariable:
    """A multi-select template variable ``name`` over the values of the label ``name`` on ``series`` (a selector
    expression), "All" matching everything, refreshed with the time range. Pure."""
    return (
        db.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query(f"label_values({series}, {name})")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def _dashboard(uid: str, title: str, description: str, rows: list[tuple[str, list]]) -> dict:
    util = names.KV_UTILIZATION.name  # template variables list the replicas that export it
    dash = (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["vtoken"])
        .editable()
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(_selector("deployment", "Deployment", util))
        .with_variable(_selector("node", "Node", f'{util}{{deployment=~"$deployment"}}'))
        .with_variable(_selector("replica", "Replica", f'{util}{{deployment=~"$deployment", node=~"$node"}}'))
    )
    next_id = 1
    for row_title, panels in rows:
        dash = dash.with_row(db.Row(row_title).id(next_id))
        next_id += 1
        for panel in panels:
            dash = dash.with_panel(panel.id(next_id))
            next_id += 1
    return json.loads(json.dumps(dash.build(), cls=JSONEncoder))


def kv_dashboard() -> dict:
    held = f"sum({names.HELD_BLOCKS.name}{{{SEL}}})"
    naive = f"sum({names.NAIVE_BLOCKS.name}{{{SEL}}})"
    savings = [
        _panel(
            timeseries,
            "KV blocks: vToken vs Naive-Evict vs packing bound",
            "Blocks held with repacking, what the paired Naive-Evict accounting would hold for the same "
            "evictions, the lower bound sum(ceil(live/B)), and the pool; on a hybrid model the blocks of its "
            "sliding-window layers (vLLM's, never evicted) beside them.",
            "none",
            [
                _q(held, "held (vToken)"),
                _q(naive, "naive (Naive-Evict)"),
                _q(f"sum({names.PACKING_BOUND_BLOCKS.name}{{{SEL}}})", "packing bound"),
                _q(f"sum({names.WINDOW_BLOCKS.name}{{{SEL}}})", "sliding window (hybrid)"),
                _q(f"sum({names.POOL_BLOCKS.name}{{{SEL}}})", "pool"),
            ],
            span=16,
        ),
        _panel(
            stat,
            "Blocks saved vs Naive-Evict",
            "1 - held / naive over the selected replicas.",
            "percentunit",
            [_q(f"1 - {held} / clamp_min({naive}, 1)", "saved")],
            span=8,
        ),
        _panel(
            timeseries,
            "Live tokens and free KV slots",
            "Live (not evicted) tokens; free slots = (pool - held - window) * B.",
            "short",
            [
                _q(f"sum({names.LIVE_TOKENS.name}{{{SEL}}})", "live tokens"),
                _q(f"sum({names.FREE_KV_TOKENS.name}{{{SEL}}})", "free KV slots"),
            ],
            span=24,
        ),
    ]
    replicas = [
        _panel(
            timeseries,
            "KV utilization per replica",
            f"(held + window) / pool; VTokenKVSaturated fires above {names.KV_SATURATED:.0%} for 10 minutes.",
            "percentunit",
            [_q(f"{names.KV_UTILIZATION.name}{{{SEL}}}", "{{replica}}")],
        )
        .min(0)
        .max(1)
        .thresholds(_thresholds((None, "green"), (names.KV_SATURATED, "red"))),
        _panel(
            timeseries,
            "Fragmentation ratio per replica",
            "1 - live / (held * B): share of held slots without a live token.",
            "percentunit",
            [_q(f"{names.FRAGMENTATION_RATIO.name}{{{SEL}}}", "{{replica}}")],
        )
        .min(0)
        .max(1)
        .thresholds(_thresholds((None, "green"), (names.FRAGMENTATION_MAX, "orange"))),
    ]
    reclamation = [
        _panel(
            timeseries,
            "Reclaimed blocks/s",
            "Blocks returned to vLLM's pool by vToken.",
            "short",
            [_per_replica_rate(names.RECLAIMED_BLOCKS)],
        ),
        _panel(
            timeseries,
            "Repack moves/s",
            "KV slot moves executed by repack plans.",
            "short",
            [_per_replica_rate(names.REPACK_MOVES)],
        ),
        _panel(
            timeseries,
            "Repack latency",
            "Duration of one repack plan (p50/p95/p99).",
            "s",
            _quantiles(names.REPACK_SECONDS),
        ),
        _panel(
            timeseries,
            "Evicted tokens/s by policy",
            "Tokens the eviction policy removed.",
            "short",
            [_per_replica_rate(names.EVICTED_TOKENS, by="policy")],
        ),
        _panel(
            timeseries,
            "KV invariant violations per replica",
            f"Violations found over the last {names.INVARIANT_WINDOW} (a leaked or miscounted block, "
            "a broken token table, a rewritten prefix-cached block; the engine log names them); must stay 0. "
            "VTokenKVInvariantViolated fires on any. Checks/s: how often the replica checked.",
            "short",
            [
                _q(
                    f"sum by (replica) (increase({names.INVARIANT_VIOLATIONS.total}{{{SEL}}}"
                    f"[{names.INVARIANT_WINDOW}]))",
                    "violations {{replica}}",
                ),
                _q(f"sum by (replica) (rate({names.INVARIANT_CHECKS.total}{{{SEL}}}[{RATE}]))", "checks/s {{replica}}"),
            ],
            span=24,
        ),
    ]
    trimmed = names.trimmed_share(selector=SEL)
    paid = [
        _panel(
            timeseries,
            "Requests trimmed",
            f"Share of finished requests that lost context to eviction over the last {names.TRIMMED_WINDOW}; "
            f"VTokenRequestsTrimmed fires above {names.TRIMMED_SHARE_MAX:.0%}. With trigger pressure a request "
            "is trimmed only while memory is short (pressure rounds/s beside it).",
            "percentunit",
            [_q(trimmed, "trimmed"), _per_replica_rate(names.PRESSURE_ROUNDS)],
            span=8,
        )
        .min(0)
        .thresholds(_thresholds((None, "green"), (names.TRIMMED_SHARE_MAX, "orange"))),
        _panel(
            timeseries,
            "Context lost per request",
            "Share of its context a finished request no longer attended to (p50/p95/p99).",
            "percentunit",
            _quantiles(names.REQUEST_EVICTED_SHARE),
            span=8,
        ),
        _panel(
            timeseries,
            "Attention mass evicted per request",
            "Share of a request's measured attention that went to tokens it evicted (attention policies; p50/p95/p99).",
            "percentunit",
            _quantiles(names.REQUEST_EVICTED_MASS),
            span=8,
        ),
    ]
    util = names.KV_UTILIZATION.name
    nodes = [
        _panel(
            timeseries,
            "Replicas per node",
            "Replicas whose metrics Prometheus scrapes, per node and in all: a lost node shows as a dip "
            "until Serve restarts its replicas elsewhere.",
            "short",
            [_q(f"count by (node) ({util}{{{SEL}}})", "{{node}}"), _q(f"count({util}{{{SEL}}})", "all")],
        ),
        _panel(
            timeseries,
            "KV utilization per node",
            "Mean held / pool over the node's replicas.",
            "percentunit",
            [_q(f"avg by (node) ({util}{{{SEL}}})", "{{node}}")],
        )
        .min(0)
        .max(1),
    ]
    return _dashboard(
        "vtoken-kv",
        "vToken / KV cache",
        "KV savings and reclamation of vToken replicas.",
        [
            ("KV savings", savings),
            ("What requests paid", paid),
            ("Per replica", replicas),
            ("Per node", nodes),
            ("Reclamation", reclamation),
        ],
    )


def sla_dashboard() -> dict:
    met, total = names.SLO_MET.total, names.REQUESTS.total
    attainment = _thresholds((None, "red"), (names.SLO_TARGET, "green"))
    sla = [
        _panel(
            stat,
            "SLA attainment (time range)",
            f"Finished requests meeting the TTFT and TPOT SLOs; target {names.SLO_TARGET:.0%}.",
            "percentunit",
            [_q(f"sum(increase({met}{{{SEL}}}[$__range])) / sum(increase({total}{{{SEL}}}[$__range]))", "attainment")],
            span=6,
        ).thresholds(attainment),
        _panel(
            timeseries,
            "SLA attainment, overall and per replica",
            "slo_met / requests.",
            "percentunit",
            [
                _q(f"sum(rate({met}{{{SEL}}}[{RATE}])) / sum(rate({total}{{{SEL}}}[{RATE}]))", "overall"),
                _q(
                    f"sum by (replica) (rate({met}{{{SEL}}}[{RATE}]))"
                    f" / sum by (replica) (rate({total}{{{SEL}}}[{RATE}]))",
                    "{{replica}}",
                ),
            ],
            span=18,
        )
        .min(0)
        .max(1)
        .thresholds(attainment),
    ]
    latency = [
        _panel(
            timeseries,
            "Time to first token",
            "TTFT of finished requests (p50/p95/p99).",
            "s",
            _quantiles(names.TTFT_SECONDS),
        ),
        _panel(
            timeseries,
            "Time per output token",
            "Mean TPOT of finished requests (p50/p95/p99).",
            "s",
            _quantiles(names.TPOT_SECONDS),
        ),
    ]
    load = [
        _panel(
            timeseries,
            "Finished requests/s per replica",
            "Requests judged against the SLO.",
            "reqps",
            [_per_replica_rate(names.REQUESTS)],
        ),
        _panel(
            timeseries,
            "Queue per replica",
            "vLLM's waiting and running requests per engine, and the running-batch limit SLO-aware admission "
            "sets (slo.admission; absent when off).",
            "short",
            [
                _q(f"sum by (replica) ({m.name}{{{SEL}}})", f"{s} {{{{replica}}}}")
                for m, s in (
                    (names.NUM_REQUESTS_WAITING, "waiting"),
                    (names.NUM_REQUESTS_RUNNING, "running"),
                    (names.ADMISSION_LIMIT, "admission limit"),
                )
            ],
        ),
        _panel(
            timeseries,
            "Finished requests/s per node",
            "Requests judged against the SLO, per node.",
            "reqps",
            [_per_replica_rate(names.REQUESTS, by="node")],
        ),
    ]
    return _dashboard(
        "vtoken-sla",
        "vToken / SLA",
        "SLA attainment, latency and load of vToken replicas.",
        [("SLA attainment", sla), ("Latency", latency), ("Load", load)],
    )


def dashboards() -> dict[str, dict]:
    """File name -> dashboard JSON model (pure, deterministic)."""
    return {"vtoken-kv.json": kv_dashboard(), "vtoken-sla.json": sla_dashboard()}


def dump(model: dict) -> str:
    return json.dumps(model, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def panel_queries(model: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every non-row panel."""
    return [(p["title"], t["expr"]) for p in model["panels"] if p["type"] != "row" for t in p.get("targets", [])]


def concrete(expr: str, rate: str = "1m", range_: str = "5m", everything: str = ".*") -> str:
    """``expr`` with Grafana's variables replaced as Grafana does with "All" selected (promtool, tests)."""
    return (
        expr.replace("$__rate_interval", rate)
        .replace("$__range", range_)
        .replace("$deployment", everything)
        .replace("$node", everything)
        .replace("$replica", everything)
    )


def main(argv: list[str]) -> int:
    files = {name: dump(model) for name, model in dashboards().items()}
    stale = [n for n, text in files.items() if not (OUT / n).is_file() or (OUT / n).read_text() != text]
    if "--check" in argv:
        if stale:
            print(f"out of date (run python dashboards/build.py): {', '.join(stale)}", file=sys.stderr)
        return 1 if stale else 0
    for name, text in files.items():
        (OUT / name).write_text(text)
    print(f"wrote {', '.join(files)} in {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
