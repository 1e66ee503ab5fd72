"""The single declaration of every Prometheus metric name vToken exports or reads, and the alert thresholds.

Each metric is one frozen ``Metric`` (name, kind, help, unit, labels); its properties give the series
names a scraper stores (a counter ``vtoken:evicted_tokens`` is scraped as ``vtoken:evicted_tokens_total``,
a histogram as ``_bucket``/``_sum``/``_count``). ``VTOKEN_METRICS`` is everything a replica exports, in
exposition order; ``VLLM_METRICS`` the vLLM-owned series the project reads (vLLM exports them, names
unchanged); ``ALL_METRICS`` both. The alert thresholds at the bottom are shared by the dashboards and the
alert rules.

Imported by vtoken/serve/telemetry/metrics.py (builds the collectors from these declarations),
vtoken/serve/telemetry/stat_logger.py (router/autoscaler keys), dashboards/build.py and k8s/rules.py (PromQL),
and the tests that check that dashboards and alerts read only exported series. Standard library only, no
vtoken import, so the two generator scripts can import it from the checkout without the serving stack.
Importing it has no side effects. docs/metrics.md describes the same series for readers.
"""

from __future__ import annotations

from dataclasses import dataclass

GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
KINDS = (GAUGE, COUNTER, HISTOGRAM)
# Added to every sample of a replica at scrape time (vtoken/serve/telemetry/metrics.py LabelledView);
# ``node`` is the Ray node id of the node the replica runs on (also its x-vtoken-node response header).
REPLICA_LABELS = ("application", "deployment", "replica", "node")


@dataclass(frozen=True)
class Metric:
    """One metric family as declared (``name`` without the ``_total`` a counter is scraped with).

    ``labels`` are the metric's own labels (the replica labels and a histogram's ``le`` come on top);
    ``buckets`` a histogram's bucket bounds, declared here for whoever fills it (the replica, the engine).
    ``unit`` is descriptive only: it is not passed to prometheus_client, which would append it to the
    name or emit it as ``# UNIT`` under OpenMetrics.
    """

    name: str
    kind: str
    help: str
    unit: str = ""
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # a histogram's ``le`` bounds (+Inf implied); empty for other kinds

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {KINDS}")
        if (self.kind == HISTOGRAM) != bool(self.buckets):
            raise ValueError(f"{self.name}: a histogram declares its buckets, other kinds none")
        if self.kind == COUNTER and self.name.endswith("_total"):
            raise ValueError(f"{self.name}: declare a counter without _total (see .total)")

    @property
    def owner(self) -> str:
        """``vtoken`` or ``vllm``: the prefix before the colon."""
        return self.name.split(":", 1)[0]

    @property
    def bare(self) -> str:
        """The name after the owner's prefix (``vtoken:repack_moves`` → ``repack_moves``): for a ``KV_COUNTERS``
        metric, the ``ReclaimCounters`` field that holds its value."""
        return self.name.split(":", 1)[1]

    def _suffixed(self, kind: str, suffix: str) -> str:
        if self.kind != kind:
            raise ValueError(f"{self.name} is a {self.kind}, not a {kind}: it has no {suffix} series")
        return self.name + suffix

    @property
    def total(self) -> str:
        """The scraped name of a counter: ``<name>_total``."""
        return self._suffixed(COUNTER, "_total")

    @property
    def bucket(self) -> str:
        return self._suffixed(HISTOGRAM, "_bucket")

    @property
    def sum(self) -> str:
        return self._suffixed(HISTOGRAM, "_sum")

    @property
    def count(self) -> str:
        return self._suffixed(HISTOGRAM, "_count")

    @property
    def series(self) -> tuple[str, ...]:
        """Every sample name a scraper stores for this metric (without prometheus_client's ``_created``)."""
        if self.kind == COUNTER:
            return (self.total,)
        if self.kind == HISTOGRAM:
            return (self.bucket, self.sum, self.count)
        return (self.name,)


# ------------------------------------------------ vToken KV gauges (read from the latest KVSnapshot)
LIVE_TOKENS = Metric("vtoken:live_tokens", GAUGE, "Live (not evicted) tokens held in the KV cache", "tokens", ("mode",))
HELD_BLOCKS = Metric("vtoken:held_blocks", GAUGE, "KV blocks held by requests", "blocks", ("mode",))
PACKING_BOUND_BLOCKS = Metric(
    "vtoken:packing_bound_blocks", GAUGE, "Sum over requests of ceil(live/B)", "blocks", ("mode",)
)
NAIVE_BLOCKS = Metric(
    "vtoken:naive_blocks", GAUGE, "Blocks the paired Naive-Evict accounting would hold", "blocks", ("mode",)
)
POOL_BLOCKS = Metric(
    "vtoken:pool_blocks", GAUGE, "KV blocks in the pool (without vLLM's null block)", "blocks", ("mode",)
)
WINDOW_BLOCKS = Metric(
    "vtoken:window_blocks",
    GAUGE,
    "KV blocks held in a hybrid model's sliding-window groups (vLLM's; 0 on other models)",
    "blocks",
    ("mode",),
)
FREE_KV_TOKENS = Metric(
    "vtoken:free_kv_tokens", GAUGE, "Free KV slots after reclamation: (pool - held - window) * B", "tokens", ("mode",)
)
FRAGMENTATION_RATIO = Metric("vtoken:fragmentation_ratio", GAUGE, "1 - live / (held * B)", "ratio", ("mode",))
KV_UTILIZATION = Metric("vtoken:kv_utilization", GAUGE, "(held + window) / pool", "ratio", ("mode",))
ADMISSION_LIMIT = Metric(
    "vtoken:admission_limit",
    GAUGE,
    "Running-batch limit SLO-aware admission holds the engine to (absent when admission is off)",
    "requests",
    ("mode",),
)
STATS_AGE_SECONDS = Metric(
    "vtoken:stats_age_seconds", GAUGE, "Seconds since the engine step these KV numbers come from", "seconds", ("mode",)
)

# ------------------------------------------ vToken cumulative counters (read from the latest KVSnapshot)
EVICTED_TOKENS = Metric("vtoken:evicted_tokens", COUNTER, "Tokens evicted by the policy", "tokens", ("policy",))
RECLAIMED_BLOCKS = Metric("vtoken:reclaimed_blocks", COUNTER, "Blocks returned to the pool by vToken", "blocks")
REPACK_MOVES = Metric("vtoken:repack_moves", COUNTER, "KV slot moves executed by repacks", "moves")
REPACK_PLANS = Metric("vtoken:repack_plans", COUNTER, "Repack plans executed", "plans")
COW_BLOCKS = Metric(
    "vtoken:cow_blocks",
    COUNTER,
    "Prefix-cached blocks replaced by a copy instead of rewritten (left in the prefix cache)",
    "blocks",
)
COW_MOVES = Metric(
    "vtoken:cow_moves",
    COUNTER,
    "KV slot copies made to keep prefix-cached blocks intact (included in repack_moves)",
    "moves",
)
COW_FALLBACKS = Metric(
    "vtoken:cow_fallbacks",
    COUNTER,
    "Prefix-cached blocks un-hashed and rewritten in place (no free replacement block)",
    "blocks",
)
INVARIANT_CHECKS = Metric(
    "vtoken:invariant_checks",
    COUNTER,
    "KV invariant checks run (when the engine goes idle and every invariant_period steps)",
    "checks",
)
INVARIANT_VIOLATIONS = Metric(
    "vtoken:invariant_violations",
    COUNTER,
    "KV invariant violations found: a leaked or miscounted block, a broken token table, "
    "a rewritten prefix-cached block (the engine log names them)",
    "violations",
)
INVARIANT_SECONDS = Metric("vtoken:invariant_seconds", COUNTER, "Time spent checking KV invariants", "seconds")
PRESSURE_ROUNDS = Metric(
    "vtoken:pressure_rounds",
    COUNTER,
    "Scheduling steps in which the KV pool could not hold the running batch's next step (trigger pressure)",
    "steps",
)
PRESSURE_EVICTED_TOKENS = Metric(
    "vtoken:pressure_evicted_tokens",
    COUNTER,
    "Tokens evicted by pressure rounds (included in evicted_tokens)",
    "tokens",
)
PRESSURE_AT_FLOOR = Metric(
    "vtoken:pressure_at_floor",
    COUNTER,
    "Pressure rounds that left the step short with every request at its floor (vLLM then preempts)",
    "steps",
)

# ------------- vToken per-request cost (the engine's cumulative histograms, vtoken/core/reporting/request_cost.py)
REQUEST_EVICTED_SHARE = Metric(
    "vtoken:request_evicted_share",
    HISTOGRAM,
    "Share of its context a finished request no longer attended to (evicted / context tokens)",
    "ratio",
    (),
    (0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9),
)
REQUEST_EVICTED_TOKENS = Metric(
    "vtoken:request_evicted_tokens",
    HISTOGRAM,
    "Context tokens a finished request no longer attended to",
    "tokens",
    (),
    (0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0),
)
REQUEST_EVICTED_MASS = Metric(
    "vtoken:request_evicted_mass",
    HISTOGRAM,
    "Share of a finished request's measured attention that went to tokens it evicted (attention policies)",
    "ratio",
    (),
    (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5),
)

# --------------------------------------------- vToken SLA series (updated once per finished request)
REQUESTS = Metric("vtoken:requests", COUNTER, "Finished requests judged against the SLO", "requests")
SLO_MET = Metric("vtoken:slo_met", COUNTER, "Finished requests that met both TTFT and TPOT SLOs", "requests")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REPACK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
TTFT_SECONDS = Metric(
    "vtoken:ttft_seconds", HISTOGRAM, "Time to first token of finished requests", "seconds", (), LATENCY_BUCKETS
)
TPOT_SECONDS = Metric(
    "vtoken:tpot_seconds", HISTOGRAM, "Mean time per output token of finished requests", "seconds", (), TPOT_BUCKETS
)
E2E_SECONDS = Metric(
    "vtoken:e2e_seconds", HISTOGRAM, "End-to-end latency of finished requests", "seconds", (), LATENCY_BUCKETS
)
REPACK_SECONDS = Metric(
    "vtoken:repack_seconds", HISTOGRAM, "Duration of one repack plan (interval mean)", "seconds", (), REPACK_BUCKETS
)
ROUTING_STATS_POLLS = Metric(
    "vtoken:routing_stats_polls",
    COUNTER,
    "Polls of record_routing_stats answered (Serve feeding the KV-aware router)",
    "polls",
)

KV_GAUGES = (
    LIVE_TOKENS,
    HELD_BLOCKS,
    PACKING_BOUND_BLOCKS,
    NAIVE_BLOCKS,
    POOL_BLOCKS,
    WINDOW_BLOCKS,
    FREE_KV_TOKENS,
    FRAGMENTATION_RATIO,
    KV_UTILIZATION,
    STATS_AGE_SECONDS,
    ADMISSION_LIMIT,
)
KV_COUNTERS = (
    EVICTED_TOKENS,
    RECLAIMED_BLOCKS,
    REPACK_MOVES,
    REPACK_PLANS,
    COW_BLOCKS,
    COW_MOVES,
    COW_FALLBACKS,
    INVARIANT_CHECKS,
    INVARIANT_VIOLATIONS,
    INVARIANT_SECONDS,
    PRESSURE_ROUNDS,
    PRESSURE_EVICTED_TOKENS,
    PRESSURE_AT_FLOOR,
)
COST_HISTOGRAMS = (REQUEST_EVICTED_SHARE, REQUEST_EVICTED_TOKENS, REQUEST_EVICTED_MASS)
SLA_METRICS = (REQUESTS, SLO_MET, TTFT_SECONDS, TPOT_SECONDS, E2E_SECONDS, REPACK_SECONDS, ROUTING_STATS_POLLS)
VTOKEN_METRICS = (
    KV_GAUGES + KV_COUNTERS + COST_HISTOGRAMS + SLA_METRICS
)  # everything a replica exports, exposition order

# ---------------------------------- vLLM-owned series the router, autoscaler and dashboards read
NUM_REQUESTS_WAITING = Metric(
    "vllm:num_requests_waiting",
    GAUGE,
    "Number of requests waiting to be processed.",
    "requests",
    ("model_name", "engine"),
)
NUM_REQUESTS_RUNNING = Metric(
    "vllm:num_requests_running",
    GAUGE,
    "Number of requests in model execution batches.",
    "requests",
    ("model_name", "engine"),
)
PREFIX_CACHE_QUERIES = Metric(
    "vllm:prefix_cache_queries",
    COUNTER,
    "Prefix cache queries, in terms of number of queried tokens.",
    "tokens",
    ("model_name", "engine"),
)
PREFIX_CACHE_HITS = Metric(
    "vllm:prefix_cache_hits",
    COUNTER,
    "Prefix cache hits, in terms of number of cached tokens.",
    "tokens",
    ("model_name", "engine"),
)
NUM_PREEMPTIONS = Metric(
    "vllm:num_preemptions",
    COUNTER,
    "Cumulative number of preemption from the engine.",
    "requests",
    ("model_name", "engine"),
)
VLLM_METRICS = (NUM_REQUESTS_WAITING, NUM_REQUESTS_RUNNING, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, NUM_PREEMPTIONS)

ALL_METRICS = VTOKEN_METRICS + VLLM_METRICS


def series_names(metrics: tuple[Metric, ...] = ALL_METRICS) -> frozenset[str]:
    """Every scraped sample name of ``metrics`` (pure)."""
    return frozenset(s for m in metrics for s in m.series)


# ------------------------------------------------ alert thresholds (dashboards/build.py, k8s/rules.py)
SLO_TARGET = 0.99  # share of finished requests that must meet the TTFT and TPOT SLOs
KV_SATURATED = 0.95  # kv_utilization = (held + window) / pool above which VTokenKVSaturated fires
FRAGMENTATION_MAX = 0.5  # fragmentation_ratio above which VTokenKVFragmentationHigh fires (pool busy)
TRIMMED_SHARE_MAX = 0.2  # share of finished requests that lost context above which VTokenRequestsTrimmed fires
TRIMMED_WINDOW = "10m"  # the window VTokenRequestsTrimmed and the dashboard's trimmed share look at
INVARIANT_WINDOW = "10m"  # VTokenKVInvariantViolated fires on any violation within it (and the panel shows it)


def trimmed_share(selector: str = "", by: str = "", window: str = TRIMMED_WINDOW) -> str:
    """PromQL: the share of finished requests that lost context to eviction over ``window`` (the ``le="0.0"``
    bucket of ``vtoken:request_evicted_share`` counts those that lost none; NaN without traffic). ``selector``:
    label matchers on both series (the dashboard's variables); ``by``: labels kept (the alert's grouping). The
    one definition the dashboard's panel and ``VTokenRequestsTrimmed`` both read (pure)."""
    share = REQUEST_EVICTED_SHARE
    total = f"sum by ({by}) " if by else "sum"
    none_lost = ", ".join(m for m in (selector, 'le="0.0"') if m)
    finished = f"{{{selector}}}" if selector else ""
    return (
        f"1 - {total}(increase({share.bucket}{{{none_lost}}}[{window}]))\n"
        f"  / {total}(increase({share.count}{finished}[{window}]))"
    )
