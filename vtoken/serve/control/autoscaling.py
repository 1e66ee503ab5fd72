"""Autoscaling on KV utilization (and engine queue depth), with a hysteresis band.

Replicas report ``record_autoscaling_stats()`` = ``{vtoken:kv_utilization, vllm:num_requests_waiting,
vllm:num_requests_running, trimmed_share, …}``; Serve averages each over ``look_back_period_s`` and calls
the policy every control-loop tick with ``ctx.aggregated_metrics[name][replica_id]``::

    n = running replicas (they report the metrics), t = Serve's current target (n + starting/replacing)
    mean_kv ≥ upscale_kv_utilization  or  Σ waiting ≥ upscale_waiting_per_replica · n
      or  mean trimmed ≥ upscale_trimmed_share  (if set)
        → max(t, n + 1, ⌈n · mean_kv / target_kv_utilization⌉)                    scale up
    mean_kv ≤ downscale_kv_utilization  and  Σ waiting = 0
        → min(n − 1, ⌈n · mean_kv / target_kv_utilization⌉)                       scale down
    otherwise → t                                                                   hold (the band)

``trimmed_share`` is the share of a replica's finished requests that lost context to eviction since its
previous report (``trimmed_since``): with ``trigger: pressure`` a request is trimmed only when memory is
short, so scaling on it adds capacity while the first requests pay instead of after an SLO burns.

Holding keeps the *target*, not the running count: a replica lost with its node (or still starting)
is replaced, not forgotten — holding at n would shrink the target to the survivors once
``downscale_delay_s`` passed, and Serve would never restore the lost replica. Scaling up counts a
replica already on its way (t > n) instead of asking for another one every tick.

The result is clamped to [min_replicas, max_replicas] (capacity-adjusted, as Serve passes them); Serve
then applies ``upscale_delay_s`` / ``downscale_delay_s`` (a decision must persist that long), the second
half of the hysteresis. Replicas that have not reported yet are left out of the mean; when none has,
the policy holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from vtoken.serve.telemetry.stat_logger import KV_UTILIZATION, NUM_WAITING, TRIMMED_SHARE


@dataclass(frozen=True)
class ScalingParams:
    """The policy's thresholds: their one declaration (``autoscaling.*`` in the serving config, Serve's
    ``policy_kwargs``, ``KVAutoscalingPolicy``). Validated on construction, the hysteresis band included.

    ``upscale_kv_utilization``: mean kv_utilization that adds replicas; ``downscale_kv_utilization``:
    at or below it (and no engine queue) one is removed — strictly below the upscale threshold;
    ``target_kv_utilization``: sizing target when scaling; ``upscale_waiting_per_replica``:
    engine-waiting requests per replica that also add replicas; ``upscale_trimmed_share``: mean share of
    finished requests trimmed by eviction that also adds replicas (``None``: not used).
    """

    __pydantic_config__ = {"extra": "forbid"}  # read by pydantic only (the serving config's edge)

    upscale_kv_utilization: float = 0.75
    downscale_kv_utilization: float = 0.25
    target_kv_utilization: float = 0.5
    upscale_waiting_per_replica: float = 2.0
    upscale_trimmed_share: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.downscale_kv_utilization < self.upscale_kv_utilization <= 1.0:
            raise ValueError(
                f"downscale_kv_utilization {self.downscale_kv_utilization} must be below "
                f"upscale_kv_utilization {self.upscale_kv_utilization} (hysteresis band), both in [0, 1]"
            )
        if not 0.0 < self.target_kv_utilization <= 1.0:
            raise ValueError(f"target_kv_utilization must be in (0, 1], got {self.target_kv_utilization}")
        if not self.upscale_waiting_per_replica > 0:
            raise ValueError(f"upscale_waiting_per_replica must be > 0, got {self.upscale_waiting_per_replica}")
        if self.upscale_trimmed_share is not None and not 0.0 < self.upscale_trimmed_share <= 1.0:
            raise ValueError(f"upscale_trimmed_share must be in (0, 1] or unset, got {self.upscale_trimmed_share}")

    def kwargs(self) -> dict[str, Any]:
        """``{field: value}`` of these thresholds: Serve's ``policy_kwargs`` for ``KVAutoscalingPolicy``."""
        return {f.name: getattr(self, f.name) for f in fields(ScalingParams)}


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str  # "up" | "down" | "hold" | "no-metrics"
    mean_kv: float | None
    waiting: float
    trimmed: float | None = None  # mean trimmed share over the replicas that reported one


def decide(
    current: int,
    kv: Mapping[Any, float],
    waiting: Mapping[Any, float],
    params: ScalingParams,
    lo: int,
    hi: int,
    target: int | None = None,
    trimmed: Mapping[Any, float] | None = None,
) -> Decision:
    """The replica count for ``current`` running replicas and their averaged metrics (pure).
    ``target``: the count Serve is working towards (default ``current``); ``trimmed``: each replica's
    trimmed share (read only when ``params.upscale_trimmed_share`` is set); see the module docstring."""
    target = current if target is None else max(0, target)
    total_waiting = float(sum(waiting.values()))
    if current <= 0:
        floor = 1 if total_waiting > 0 else lo
        return Decision(max(lo, min(hi, max(target, floor))), "hold", None, total_waiting)
    values = [float(v) for v in kv.values() if v is not None and math.isfinite(float(v))]
    if not values:
        return Decision(max(lo, min(hi, target)), "no-metrics", None, total_waiting)
    mean_kv = sum(values) / len(values)
    shares = [float(v) for v in (trimmed or {}).values() if v is not None and math.isfinite(float(v))]
    mean_trimmed = sum(shares) / len(shares) if shares else None
    trimming = (
        params.upscale_trimmed_share is not None
        and mean_trimmed is not None
        and mean_trimmed >= params.upscale_trimmed_share
    )
    sized = math.ceil(current * mean_kv / params.target_kv_utilization - 1e-9)
    if (
        mean_kv >= params.upscale_kv_utilization
        or total_waiting >= params.upscale_waiting_per_replica * current
        or trimming
    ):
        desired, reason = max(target, current + 1, sized), "up"
    elif mean_kv <= params.downscale_kv_utilization and total_waiting == 0:
        desired, reason = min(current - 1, sized), "down"
    else:
        desired, reason = target, "hold"
    return Decision(max(lo, min(hi, desired)), reason, mean_kv, total_waiting, mean_trimmed)


class KVAutoscalingPolicy:
    """Serve ``AutoscalingPolicy`` callable (``policy_function`` = this class, ``policy_kwargs`` = the
    fields of ``ScalingParams``). Serve instantiates it once per deployment and calls it every tick."""

    def __init__(self, **kwargs: float) -> None:
        self.params = ScalingParams(**kwargs)

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        running = set(ctx.running_replicas)
        kv = {r: v for r, v in (metrics.get(KV_UTILIZATION) or {}).items() if r in running}
        waiting = {r: v for r, v in (metrics.get(NUM_WAITING) or {}).items() if r in running}
        trimmed = {r: v for r, v in (metrics.get(TRIMMED_SHARE) or {}).items() if r in running}
        d = decide(
            ctx.current_num_replicas,
            kv,
            waiting,
            self.params,
            ctx.capacity_adjusted_min_replicas,
            ctx.capacity_adjusted_max_replicas,
            getattr(ctx, "target_num_replicas", None),
            trimmed,
        )
        info = {"reason": d.reason, "mean_kv": d.mean_kv, "waiting": d.waiting, "trimmed": d.trimmed}
        return d.desired, {"vtoken": info}
