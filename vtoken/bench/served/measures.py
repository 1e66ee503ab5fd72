"""``vtoken bench serve``'s numbers: what one run measured and what a variant's runs add up to.

``ReplicaMetrics`` polls the replica's ``/metrics`` during a run (peak running batch, prefix-cache growth,
preemptions, the lowest SLO-admission limit); ``run_summary`` reads vLLM's saved result;
``max_rate_meeting`` and ``rate_at_target`` are the SLA-constrained throughput of a variant's runs. All
pure but ``ReplicaMetrics`` (a polling thread, HTTP GETs).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import TYPE_CHECKING

import httpx

from vtoken.metric_names import (
    ADMISSION_LIMIT,
    NUM_PREEMPTIONS,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    PRESSURE_ROUNDS,
    REQUEST_EVICTED_MASS,
    REQUEST_EVICTED_SHARE,
    REQUEST_EVICTED_TOKENS,
)

if TYPE_CHECKING:
    from vtoken.bench.served.plan import ServeBenchSetup

ATTAINMENT_TARGET = 0.9  # "SLA-constrained throughput": the highest rate meeting the SLOs for ≥ 90 %


def variant_label(mode: str, policy: str | None, admission: bool | None = False, trigger: str = "step") -> str:
    """How progress lines, summaries and the plot name a variant: ``none`` or ``mode/policy``, ``@pressure``
    for a trigger other than the fixed budget's ``step``, ``+admission`` when SLO-aware admission was on
    (pure)."""
    name = mode if policy is None else f"{mode}/{policy}"
    return name + ("" if trigger == "step" else f"@{trigger}") + (" +admission" if admission else "")


def report_label(variant: dict) -> str:
    """``variant_label`` of one variant's report (``run_variant``'s dict; a report from before triggers
    existed ran ``step``). Pure."""
    return variant_label(variant["mode"], variant["policy"], variant.get("admission"), variant.get("trigger", "step"))


class ReplicaMetrics:
    """Polls a replica's ``/metrics`` every ``period`` s in a thread (context manager; side effect: HTTP
    GETs): ``peak`` is the largest ``vllm:num_requests_running`` seen; ``prefix_hits`` / ``prefix_queries``
    are the prefix-cache counters' growth (tokens) between the first and the last poll, ``preemptions`` is
    ``vllm:num_preemptions``' growth (requests vLLM preempted for KV blocks); ``limit_low`` is the lowest
    ``vtoken:admission_limit`` seen (``None``: SLO-aware admission off); ``timeline`` is
    ``[seconds since start, running, waiting, admission limit]`` at each scrape whose three gauges differ from
    the previous entry's (lossless at the poll period, compact: a steady batch is one entry); ``cost`` is what
    the requests finished meanwhile paid (``cost_of``: the cost histograms' growth)."""

    def __init__(self, url: str, period: float = 0.5) -> None:
        self.url, self.period, self.peak = url, period, 0
        self.limit_low: int | None = None
        self.timeline: list[list[float | int | None]] = []
        self._t0 = time.monotonic()
        self._first: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._stop = threading.Event()

    @staticmethod
    def sample(text: str, name: str, label: str = "") -> float | None:
        """The sum over label sets of the samples named ``name`` in an exposition (pure); ``label``
        (``le="0.0"``): only the label sets that hold it."""
        values = re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})?\s+([0-9.eE+-]+)", text, re.MULTILINE)
        values = [v for labels, v in values if label in labels]
        return sum(float(v) for v in values) if values else None

    def read(self, text: str) -> None:
        """Fold one scrape into the peak and the counters (mutates)."""
        running = self.sample(text, NUM_REQUESTS_RUNNING.name)
        if running is not None:
            self.peak = max(self.peak, int(running))
        limit = self.sample(text, ADMISSION_LIMIT.name)
        if limit is not None:
            self.limit_low = int(limit) if self.limit_low is None else min(self.limit_low, int(limit))
        waiting = self.sample(text, NUM_REQUESTS_WAITING.name)
        state = [None if v is None else int(v) for v in (running, waiting, limit)]
        if state != (self.timeline[-1][1:] if self.timeline else None):
            self.timeline.append([round(time.monotonic() - self._t0, 1), *state])
        for metric in (PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES, NUM_PREEMPTIONS, PRESSURE_ROUNDS):
            self._fold(metric.name, self.sample(text, metric.total))
        for name in _COST_SERIES:
            self._fold(name, self.sample(text, name))
        self._fold(_UNTRIMMED, self.sample(text, REQUEST_EVICTED_SHARE.bucket, 'le="0.0"'))

    def _fold(self, name: str, value: float | None) -> None:
        if value is not None:
            self._first.setdefault(name, value)
            self._last[name] = value

    def growth(self, metric) -> float:
        name = metric if isinstance(metric, str) else metric.name
        return self._last.get(name, 0.0) - self._first.get(name, 0.0)

    @property
    def cost(self) -> dict | None:
        """What the requests finished while polling paid (``None``: the server exports no cost histograms)."""
        if REQUEST_EVICTED_SHARE.count not in self._last:
            return None
        return cost_of({name: self.growth(name) for name in (*_COST_SERIES, _UNTRIMMED, PRESSURE_ROUNDS.name)})

    @property
    def prefix_hits(self) -> float:
        return self.growth(PREFIX_CACHE_HITS)

    @property
    def prefix_queries(self) -> float:
        return self.growth(PREFIX_CACHE_QUERIES)

    @property
    def preemptions(self) -> int | None:
        """``None`` when no scrape carried the counter."""
        return int(self.growth(NUM_PREEMPTIONS)) if NUM_PREEMPTIONS.name in self._last else None

    def _scrape(self, http: httpx.Client) -> None:
        with contextlib.suppress(httpx.HTTPError):
            self.read(http.get(self.url).text)

    def __enter__(self) -> ReplicaMetrics:
        self._http = httpx.Client(timeout=5)
        self._t0 = time.monotonic()
        self._scrape(self._http)  # the counters' start, before the first request
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(self.period):
            self._scrape(self._http)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        time.sleep(self.period)  # the last counters: vLLM's stat loggers run on their own interval
        self._scrape(self._http)
        self._http.close()


_COST_SERIES = (
    REQUEST_EVICTED_SHARE.count,
    REQUEST_EVICTED_SHARE.sum,
    REQUEST_EVICTED_TOKENS.sum,
    REQUEST_EVICTED_MASS.count,
    REQUEST_EVICTED_MASS.sum,
)
_UNTRIMMED = REQUEST_EVICTED_SHARE.bucket + '{le="0.0"}'


def cost_of(growth: dict[str, float]) -> dict:
    """The cost summary of one run from its counters' growth (pure): requests finished and trimmed (lost at
    least one token), the trimmed share, the mean share of context lost per request and per trimmed
    request, the tokens evicted, the mean attention mass evicted (requests with scores; ``None``: none),
    and the pressure rounds taken."""
    finished = int(round(growth[REQUEST_EVICTED_SHARE.count]))
    trimmed = finished - int(round(growth[_UNTRIMMED]))
    share_sum, scored = growth[REQUEST_EVICTED_SHARE.sum], int(round(growth[REQUEST_EVICTED_MASS.count]))
    return {
        "finished": finished,
        "trimmed": trimmed,
        "trimmed_share": round(trimmed / finished, 4) if finished else None,
        "evicted_share_mean": round(share_sum / finished, 4) if finished else None,
        "evicted_share_mean_trimmed": round(share_sum / trimmed, 4) if trimmed else None,
        "evicted_tokens": int(round(growth[REQUEST_EVICTED_TOKENS.sum])),
        "evicted_mass_mean": round(growth[REQUEST_EVICTED_MASS.sum] / scored, 4) if scored else None,
        "pressure_rounds": int(round(growth[PRESSURE_ROUNDS.name])),
    }


def run_summary(
    result: dict,
    s: ServeBenchSetup,
    rate: float,
    peak: int,
    prefix: tuple[float, float] = (0, 0),
    limit_low: int | None = None,
    preemptions: int | None = None,
    timeline: list | None = None,
    cost: dict | None = None,
) -> dict:
    """One run's numbers from vLLM's saved result (pure). Attainment counts failed requests as misses.
    ``cost``: ``ReplicaMetrics.cost`` (what the run's requests lost to eviction; ``None``: not measured).
    ``limit_low``: the lowest running-batch limit SLO-aware admission set during the run (``None``: off);
    ``preemptions``: requests vLLM preempted for KV blocks during the run (``None``: not measured);
    ``timeline``: ``ReplicaMetrics.timeline`` (running, waiting, admission limit as they changed)."""
    duration = float(result.get("duration") or 0.0)
    goodput = float(result.get("request_goodput") or 0.0)
    met, completed = round(goodput * duration), int(result.get("completed", 0))
    return {
        "rate": rate,
        "completed": completed,
        "failed": s.num_prompts - completed,
        "duration_s": round(duration, 2),
        "request_throughput": round(float(result.get("request_throughput", 0)), 4),
        "goodput_req_s": round(goodput, 4),
        "slo_attainment": round(met / s.num_prompts, 4),
        "output_tok_s": round(float(result.get("output_throughput", 0)), 2),
        **{f"{m}_{q}_ms": _ms(result, m, q) for m in ("ttft", "tpot") for q in ("p50", "p99")},
        "peak_running": peak,
        "admission_limit_min": limit_low,
        "preemptions": preemptions,
        "prefix_cache_hit_rate": round(prefix[0] / prefix[1], 4) if prefix[1] else None,  # tokens hit / asked
        "errors": sorted({str(e)[:300] for e in result.get("errors") or () if e})[:3],  # why requests failed
        "timeline": timeline or [],
        "cost": cost,
    }


def _ms(result: dict, metric: str, q: str) -> float | None:
    key = "median" if q == "p50" else q
    value = result.get(f"{key}_{metric}_ms")
    return None if value is None else round(float(value), 1)


def max_rate_meeting(runs: list[dict], target: float = ATTAINMENT_TARGET) -> float | None:
    """The highest rate whose run met the SLOs for ≥ ``target`` of its requests, with every lower rate
    meeting it too (pure); ``None`` if the lowest rate already failed."""
    best = None
    for run in sorted(runs, key=lambda r: r["rate"]):
        if run["slo_attainment"] < target:
            break
        best = run["rate"]
    return best


def sweep_done(runs: list[dict], stop_after_misses: int, target: float = ATTAINMENT_TARGET) -> bool:
    """Whether a variant's ascending sweep may stop (pure): its last ``stop_after_misses`` runs all missed
    ``target``. ``0`` never stops. Only the first miss enters ``max_rate_meeting`` and ``rate_at_target``, so
    stopping after it changes neither; the rates not run are absent from the JSON (not passed, not failed)."""
    if stop_after_misses < 1 or len(runs) < stop_after_misses:
        return False
    return all(r["slo_attainment"] < target for r in runs[-stop_after_misses:])


def rate_at_target(runs: list[dict], target: float = ATTAINMENT_TARGET) -> float | None:
    """Where attainment crosses ``target`` (pure): linear between ``max_rate_meeting`` and the next rate run
    (the first that missed); ``max_rate_meeting`` itself when no higher rate missed, ``None`` when the lowest
    rate already missed. Less tied to the grid than ``max_rate_meeting``, and an estimate between two runs."""
    best = max_rate_meeting(runs, target)
    if best is None:
        return None
    above = sorted((r for r in runs if r["rate"] > best), key=lambda r: r["rate"])
    if not above:
        return best
    low = max((r for r in runs if r["rate"] == best), key=lambda r: r["slo_attainment"])
    high = above[0]
    share = (low["slo_attainment"] - target) / (low["slo_attainment"] - high["slo_attainment"])
    return round(best + share * (high["rate"] - best), 4)
