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
    from vtoken.vllm.stats import vtoken_stats_from

    class MyLogger(StatLoggerBase):
        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            vt = vtoken_stats_from(scheduler_stats)      # KVSnapshot | None
            if vt is not None:
                self.free_kv_tokens = vt.free_blocks * vt.block_size

    AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(cfg), model=...), stat_loggers=[MyLogger])

The values refresh once per engine step; consumers must tolerate staleness. SLO-aware admission's limit
travels apart from the snapshot (``vtoken:admission_limit``, ``encode_admission`` / ``admission_limit_from``):
it is reported also when vToken's accounting is off (mode ``none``).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from vtoken.core.kvstats import KVSnapshot, ReclaimCounters

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
    return out


def decode(items: dict[str, int]) -> KVSnapshot | None:
    """Inverse of ``encode`` (``source="vtoken"``, ``at`` = now); ``None`` when the dict carries no vToken
    keys or a different field set (an engine of another version)."""
    raw: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for key, value in items.items():
        if not key.startswith(PREFIX) or key == ADMISSION_LIMIT:
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
    return KVSnapshot(**raw, counters=ReclaimCounters(**counters), source="vtoken", **labels)


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
