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
            vt = vtoken_stats_from(scheduler_stats)      # VTokenStats | None
            if vt is not None:
                self.free_kv_tokens = vt.free_blocks * vt.block_size

    AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(cfg), model=...), stat_loggers=[MyLogger])

The values refresh once per engine step; consumers must tolerate staleness.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from vtoken.core import gauges

PREFIX = "vtoken:"
_US = 1_000_000


@dataclass(frozen=True)
class VTokenStats:
    """One engine's vToken state at the end of a scheduling step.

    Gauges: ``live_tokens`` (Σ live tokens over requests with a token table), ``held_blocks`` (blocks those
    requests hold from vLLM's pool), ``packing_bound_blocks`` (Σ ⌈live/B⌉), ``naive_blocks`` (what the paired
    naive accounting would hold), ``pool_blocks`` (usable blocks in the pool), ``free_blocks``,
    ``num_requests``. Counters (monotonic since engine start): ``evicted_tokens_total``,
    ``reclaimed_blocks_total`` (blocks returned by repacks), ``repack_moves_total``, ``repack_seconds_total``
    (worker time spent moving KV), ``num_plans``, ``preemptions_total``. Labels: ``policy``, ``mode``.
    """

    live_tokens: int
    held_blocks: int
    packing_bound_blocks: int
    naive_blocks: int
    pool_blocks: int
    block_size: int
    evicted_tokens_total: int
    reclaimed_blocks_total: int
    repack_moves_total: int
    repack_seconds_total: float
    num_plans: int
    free_blocks: int = 0
    num_requests: int = 0
    preemptions_total: int = 0
    policy: str = ""
    mode: str = ""

    @property
    def fragmentation_ratio(self) -> float:
        """1 − live / (held·B): the share of held slots that hold no live token."""
        return gauges.fragmentation_ratio(self.live_tokens, self.held_blocks, self.block_size)

    @property
    def kv_utilization(self) -> float:
        """held / pool."""
        return gauges.kv_utilization(self.held_blocks, self.pool_blocks)


@dataclass
class Counters:
    """The scheduler's running totals (mutable; one per engine)."""

    evicted_tokens: int = 0
    reclaimed_blocks: int = 0
    moves: int = 0
    move_seconds: float = 0.0
    plans: int = 0
    preemptions: int = 0
    carried_reservations: int = 0  # reuse+repack: steps a pre-placed decode slot waited because vLLM did not schedule it


_LABELS = ("policy", "mode")


def encode(stats: VTokenStats) -> dict[str, int]:
    """``VTokenStats`` → ``{"vtoken:<field>": int}`` (labels as ``"vtoken:policy=h2o": 1``)."""
    out: dict[str, int] = {}
    for f in fields(stats):
        value = getattr(stats, f.name)
        if f.name in _LABELS:
            out[f"{PREFIX}{f.name}={value}"] = 1
        elif f.name == "repack_seconds_total":
            out[f"{PREFIX}repack_us_total"] = int(round(value * _US))
        else:
            out[f"{PREFIX}{f.name}"] = int(value)
    return out


def decode(items: dict[str, int]) -> VTokenStats | None:
    """Inverse of ``encode``; ``None`` when the dict carries no vToken keys."""
    kw: dict[str, Any] = {}
    for key, value in items.items():
        if not key.startswith(PREFIX):
            continue
        name = key[len(PREFIX) :]
        if "=" in name:
            label, text = name.split("=", 1)
            if label in _LABELS:
                kw[label] = text
        elif name == "repack_us_total":
            kw["repack_seconds_total"] = value / _US
        else:
            kw[name] = int(value)
    if not kw:
        return None
    known = {f.name for f in fields(VTokenStats)}
    kw = {k: v for k, v in kw.items() if k in known}
    try:
        return VTokenStats(**kw)
    except TypeError:  # an older/newer engine sent a different field set
        return None


def encode_stats(scheduler_stats: Any, stats: VTokenStats) -> None:
    """Write ``stats`` into a vLLM ``SchedulerStats`` (mutates its ``running_lora_adapters`` dict)."""
    scheduler_stats.running_lora_adapters.update(encode(stats))


def vtoken_stats_from(scheduler_stats: Any) -> VTokenStats | None:
    """The vToken gauges riding on a ``SchedulerStats`` (``None``: no stats, or vToken is off)."""
    if scheduler_stats is None:
        return None
    items = getattr(scheduler_stats, "running_lora_adapters", None)
    if not items:
        return None
    return decode(items)
