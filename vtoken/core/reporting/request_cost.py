"""What eviction cost each request, declared once: the per-request record a response carries and the
engine-wide histograms the replica exports (docs/metrics.md, docs/serving.md *What a request paid*).

A finished request's ``RequestCost`` is read off its token table when it leaves the engine::

    logical  0 ............................................. seen-1      (its context: prompt + output
    table    [ live | dead | live | live | dead | ... | live ]            that entered the KV cache)
    evicted_tokens  = seen − live                  tokens its last step did not attend to
    evicted_share   = evicted_tokens / seen
    evicted_mass    = Σ accumulated[dead] / Σ accumulated[0, seen)   (attention policies only: the share
                      of the attention the policy measured that went to tokens it later evicted; ``None``
                      when the request collected no attention statistics)

A preempted request is recomputed in full and evicts again from fresh scores, so only its last table
counts. ``CostStats`` folds finished requests into three cumulative histograms whose bucket bounds are the
metric declarations' (vtoken/metric_names.py): the engine owns them (they restart with it, like every
``vtoken:*`` counter) and the replica exports them as they are. A request is *trimmed* when it lost at
least one token: the ``le="0"`` bucket of ``vtoken:request_evicted_share`` counts the untrimmed ones.
Everything here is frozen and pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vtoken import metric_names as names
from vtoken.core.token_table import NO_SLOT


@dataclass(frozen=True)
class RequestCost:
    """What one finished request lost (module docstring). ``evicted_mass`` is ``None`` without scores."""

    evicted_tokens: int
    context_tokens: int
    evicted_mass: float | None = None

    @property
    def evicted_share(self) -> float:
        return self.evicted_tokens / self.context_tokens if self.context_tokens else 0.0

    @classmethod
    def of_table(cls, table, with_mass: bool) -> RequestCost:
        """The cost read off a ``TokenTable`` (``None`` table: nothing was computed, nothing lost). Pure."""
        if table is None:
            return cls(0, 0, 0.0 if with_mass else None)
        seen = table.seen
        mass = None
        if with_mass:
            acc = table.accumulated[:seen]
            total = float(acc.sum())
            dead = table.slot_of[:seen] == NO_SLOT
            mass = float(acc[dead].sum()) / total if total > 0 else 0.0
        return cls(seen - table.live, seen, mass)

    def as_dict(self) -> dict:
        """The response field's value (``vtoken`` in a completion; docs/serving.md)."""
        return {
            "evicted_tokens": self.evicted_tokens,
            "context_tokens": self.context_tokens,
            "evicted_share": round(self.evicted_share, 6),
            "evicted_attention_mass": None if self.evicted_mass is None else round(self.evicted_mass, 6),
        }


@dataclass(frozen=True)
class Histogram:
    """A cumulative histogram over ``bounds`` (Prometheus' ``le`` buckets; ``+Inf`` implied):
    ``counts[i]`` = observations ≤ ``bounds[i]``, ``count`` all of them, ``total`` their sum."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...] = ()
    count: int = 0
    total: float = 0.0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"histogram bounds must increase strictly: {self.bounds}")
        if not self.counts:
            object.__setattr__(self, "counts", (0,) * len(self.bounds))
        if len(self.counts) != len(self.bounds):
            raise ValueError(f"{len(self.counts)} counts for {len(self.bounds)} bounds")

    def observe(self, value: float) -> Histogram:
        """A copy with ``value`` added (pure)."""
        counts = tuple(c + (value <= b) for c, b in zip(self.counts, self.bounds, strict=True))
        return Histogram(self.bounds, counts, self.count + 1, self.total + value)

    def buckets(self) -> list[tuple[str, int]]:
        """``[(le, cumulative count)]`` with ``+Inf`` last: prometheus_client's histogram family form."""
        return [(_le(b), c) for b, c in zip(self.bounds, self.counts, strict=True)] + [("+Inf", self.count)]


def _le(bound: float) -> str:
    return repr(float(bound))


def _hist(metric: names.Metric) -> Histogram:
    return Histogram(metric.buckets)


@dataclass(frozen=True)
class CostStats:
    """Finished requests' costs since the engine started (frozen; ``add`` returns the updated copy).
    ``share`` and ``tokens`` count every request vToken managed, ``mass`` those with attention scores."""

    share: Histogram = field(default_factory=lambda: _hist(names.REQUEST_EVICTED_SHARE))
    tokens: Histogram = field(default_factory=lambda: _hist(names.REQUEST_EVICTED_TOKENS))
    mass: Histogram = field(default_factory=lambda: _hist(names.REQUEST_EVICTED_MASS))

    def add(self, cost: RequestCost) -> CostStats:
        mass = self.mass if cost.evicted_mass is None else self.mass.observe(cost.evicted_mass)
        return CostStats(self.share.observe(cost.evicted_share), self.tokens.observe(cost.evicted_tokens), mass)

    @property
    def trimmed(self) -> int:
        """Requests that lost at least one token."""
        return self.share.count - self.share.counts[0]

    def by_metric(self) -> tuple[tuple[names.Metric, Histogram], ...]:
        return (
            (names.REQUEST_EVICTED_SHARE, self.share),
            (names.REQUEST_EVICTED_TOKENS, self.tokens),
            (names.REQUEST_EVICTED_MASS, self.mass),
        )
