"""SLA accounting: each finished request's TTFT and mean TPOT against the configured SLOs.

Latencies come from vLLM's own per-request accounting (``FinishedRequestStats``, delivered to stat
loggers when a request finishes), so they include queueing, tokenization and preemptions::

    arrival ──queue──prefill──▶ first token ──decode──▶ last token
    |◀──────────── TTFT ──────────────────▶|◀── decode_time ──▶|
    |◀────────────────────────── e2e_latency ───────────────────▶|

    TTFT = e2e_latency − decode_time            TPOT = decode_time / (generated − 1)

A request meets its SLO when TTFT ≤ ``ttft_ms`` and (if it generated ≥ 2 tokens) TPOT ≤ ``tpot_ms``.
A request that produced no token (aborted, rejected by the engine) never meets it. This is DistServe's
"goodput" definition, the one ``vllm bench serve --goodput ttft:MS tpot:MS`` uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SloTargets:
    ttft_s: float
    tpot_s: float

    @classmethod
    def from_ms(cls, ttft_ms: float, tpot_ms: float) -> SloTargets:
        return cls(ttft_ms / 1000.0, tpot_ms / 1000.0)


@dataclass(frozen=True)
class RequestLatency:
    """One finished request. ``ttft_s``/``tpot_s`` are None when not measurable."""

    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    generated_tokens: int
    finish_reason: str


def latency_of(fin: Any) -> RequestLatency:
    """From a vLLM ``FinishedRequestStats`` (pure)."""
    generated = int(getattr(fin, "num_generation_tokens", 0))
    e2e = float(getattr(fin, "e2e_latency", 0.0))
    decode = float(getattr(fin, "decode_time", 0.0))
    reason = getattr(fin, "finish_reason", "")
    reason = str(getattr(reason, "name", reason)).lower()
    if generated <= 0:
        return RequestLatency(None, None, e2e, 0, reason)
    ttft = max(0.0, e2e - max(0.0, decode))
    tpot = float(getattr(fin, "mean_time_per_output_token", 0.0)) if generated >= 2 else None
    return RequestLatency(ttft, tpot, e2e, generated, reason)


def meets_slo(lat: RequestLatency, slo: SloTargets) -> bool:
    """Whether ``lat`` satisfies ``slo`` (pure; see the module docstring for the rule)."""
    if lat.ttft_s is None or lat.ttft_s > slo.ttft_s:
        return False
    return lat.tpot_s is None or lat.tpot_s <= slo.tpot_s
