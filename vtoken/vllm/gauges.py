"""vToken gauges for the serving front end, carried on vLLM's own ``SchedulerStats`` (no RPC, no stall).

vLLM's engine core builds a ``SchedulerStats`` every step (when stats logging is on, as in ``vllm serve``
and ``AsyncLLM``) and ships it to the front end inside ``EngineCoreOutputs``, where every stat logger's
``record(scheduler_stats, ...)`` receives it. That hop is msgspec with a typed schema: a subclass or an
extra attribute is dropped on decode (checked against 0.32). What survives is the content of its
``dict[str, int]`` fields, so the vToken scheduler writes its gauges into
``SchedulerStats.running_lora_adapters`` under keys that start with ``"vtoken:"`` (integers only; seconds
travel as microseconds). vLLM reads that dict only for the ``vllm:lora_requests_info`` gauge, which exists
only when LoRA is enabled (then the extra keys show up in that gauge's label; documented limitation).

Reading them in a stat logger::

    from vllm.v1.metrics.loggers import StatLoggerBase
    from vtoken.vllm.gauges import vtoken_stats_from

    class MyLogger(StatLoggerBase):
        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            vt = vtoken_stats_from(scheduler_stats)      # KVSnapshot | None
            if vt is not None:
                self.free_kv_tokens = vt.free_blocks * vt.block_size

    AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(cfg), model=...), stat_loggers=[MyLogger])

The values refresh once per engine step; consumers must tolerate staleness. SLO-aware admission's limit
travels apart from the snapshot (``vtoken:admission_limit``, ``encode_admission`` / ``admission_limit_from``):
it is reported also when vToken's accounting is off (mode ``none``).

The finished requests' cost histograms (``KVSnapshot.costs``, vtoken/core/reporting/request_cost.py) ride along as
``vtoken:cost:<histogram>:<i>`` (cumulative bucket counts), ``…:count`` and ``…:sum_us`` (the sum in
millionths). Each request's own cost travels in-band instead, with its last output (``cost_params``).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from vtoken.core.reporting.engine_kv import KVSnapshot, ReclaimCounters
from vtoken.core.reporting.request_cost import CostStats, Histogram, RequestCost

PREFIX = "vtoken:"
_US = 1_000_000
_LABELS = ("policy", "mode")
_GAUGES = (
    "live_tokens",
    "held_blocks",
    "packing_bound_blocks",
    "naive_blocks",
    "pool_blocks",
    "block_size",
    "num_requests",
    "window_blocks",
)  # the KVSnapshot fields the engine fills (the replica adds its queues)
_SECONDS = ("repack_seconds", "invariant_seconds")  # the float counters: carried as integer microseconds
ADMISSION_LIMIT = f"{PREFIX}admission_limit"  # KVSnapshot.admission_limit, carried on its own (any mode)
COST = f"{PREFIX}cost:"  # KVSnapshot.costs: one key per histogram bucket, count and sum
_COST_FIELDS = ("share", "tokens", "mass")  # CostStats' histograms, in its field order
RESPONSE_KEY = "vtoken"  # the per-request cost's key in kv_transfer_params and in a served response


def encode(snap: KVSnapshot) -> dict[str, int]:
    """``KVSnapshot`` → ``{"vtoken:<field>": int}`` (counters by their names, the seconds counters as
    microseconds, e.g. ``vtoken:repack_seconds_us``, labels as ``"vtoken:policy=h2o": 1``)."""
    out = {f"{PREFIX}{name}": int(getattr(snap, name)) for name in _GAUGES}
    for name in ReclaimCounters.names():
        value = getattr(snap.counters, name)
        if name in _SECONDS:
            out[f"{PREFIX}{name}_us"] = int(round(value * _US))
        else:
            out[f"{PREFIX}{name}"] = int(value)
    for label in _LABELS:
        out[f"{PREFIX}{label}={getattr(snap, label)}"] = 1
    for name in _COST_FIELDS:
        hist: Histogram = getattr(snap.costs, name)
        out.update({f"{COST}{name}:{i}": c for i, c in enumerate(hist.counts)})
        out[f"{COST}{name}:count"] = hist.count
        out[f"{COST}{name}:sum_us"] = int(round(hist.total * _US))
    return out


def _decode_costs(items: dict[str, int]) -> CostStats:
    """The ``vtoken:cost:*`` keys back into ``CostStats`` (zero histograms where keys are missing)."""
    empty = CostStats()
    out = {}
    for name in _COST_FIELDS:
        bounds = getattr(empty, name).bounds
        counts = tuple(int(items.get(f"{COST}{name}:{i}", 0)) for i in range(len(bounds)))
        total = items.get(f"{COST}{name}:sum_us", 0) / _US
        out[name] = Histogram(bounds, counts, int(items.get(f"{COST}{name}:count", 0)), total)
    return CostStats(**out)


def decode(items: dict[str, int]) -> KVSnapshot | None:
    """Inverse of ``encode`` (``source="vtoken"``, ``at`` = now); ``None`` when the dict carries no vToken
    keys or a different field set (an engine of another version)."""
    raw: dict[str, Any] = {}
    labels: dict[str, Any] = {}
    for key, value in items.items():
        if not key.startswith(PREFIX) or key == ADMISSION_LIMIT or key.startswith(COST):
            continue
        name = key[len(PREFIX) :]
        if "=" in name:
            label, text = name.split("=", 1)
            if label in _LABELS:
                labels[label] = text
        elif name.endswith("_us") and name[:-3] in _SECONDS:
            raw[name[:-3]] = value / _US
        else:
            raw[name] = int(value)
    if not raw:
        return None
    counters = {name: raw.pop(name) for name in ReclaimCounters.names() if name in raw}
    if set(raw) != set(_GAUGES) or len(counters) != len(fields(ReclaimCounters)):
        return None
    costs = _decode_costs(items)
    return KVSnapshot(**raw, counters=ReclaimCounters(**counters), costs=costs, source="vtoken", **labels)


def encode_stats(scheduler_stats: Any, snap: KVSnapshot) -> None:
    """Write ``snap`` into a vLLM ``SchedulerStats`` (mutates its ``running_lora_adapters`` dict)."""
    scheduler_stats.running_lora_adapters.update(encode(snap))


def vtoken_stats_from(scheduler_stats: Any) -> KVSnapshot | None:
    """The vToken snapshot riding on a ``SchedulerStats`` (``None``: no stats, or vToken is off)."""
    if scheduler_stats is None:
        return None
    items = getattr(scheduler_stats, "running_lora_adapters", None)
    if not items:
        return None
    return decode(items)


def encode_admission(scheduler_stats: Any, limit: int) -> None:
    """Write SLO-aware admission's current running-batch ``limit`` into a vLLM ``SchedulerStats`` (mutates it)."""
    scheduler_stats.running_lora_adapters[ADMISSION_LIMIT] = int(limit)


def admission_limit_from(scheduler_stats: Any) -> int | None:
    """The admission limit riding on a ``SchedulerStats`` (``None``: no stats, or admission is off)."""
    items = getattr(scheduler_stats, "running_lora_adapters", None) or {}
    value = items.get(ADMISSION_LIMIT)
    return None if value is None else int(value)


def cost_params(kv_transfer_params: dict | None, cost: RequestCost) -> dict:
    """vLLM's ``kv_transfer_params`` of a finished request with its cost added under ``"vtoken"`` (a new
    dict). That dict is the one per-request field vLLM carries from the scheduler to the response
    (``EngineCoreOutput`` → ``RequestOutput`` → the OpenAI response's ``kv_transfer_params``)."""
    return {**(kv_transfer_params or {}), RESPONSE_KEY: cost.as_dict()}


def cost_from(kv_transfer_params: dict | None) -> dict | None:
    """The cost dict a finished output carries (``None``: vToken did not manage the request)."""
    return (kv_transfer_params or {}).get(RESPONSE_KEY)
